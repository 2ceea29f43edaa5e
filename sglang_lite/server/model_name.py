"""The name the served model goes by in the APIs (``model`` fields, errors), from the server arguments alone."""

from __future__ import annotations

import os

from sglang_lite import assets
from sglang_lite.server_args import ServerArgs


def served_model_name(args: ServerArgs) -> str:
    """``--served-model-name``, else a hub id as given (``org/name``), else the model folder's name."""
    if args.served_model_name:
        return args.served_model_name
    path = args.model_path
    if path and not os.path.isdir(path) and assets.is_hub_id(path):
        return path
    return os.path.basename(os.path.normpath(args.model_dir))
