"""Images in requests, on the HTTP side: decoded (``multimodal.media``: data URLs, remote ones only with
``--allow-remote-images``), preprocessed for the vision tower (``multimodal.image_processor``), and their
placeholders in the rendered prompt expanded into one token per merged patch, each image's tokens carrying an id of
its own (``multimodal.inputs.image_token``: the prefix cache tells images apart by it).

Every failure is the request's fault and a 400 naming the image: a URL the policy refuses (never fetched), bytes
that are no image, an image past the size limits, an image sent to a model without a vision tower.
"""

from __future__ import annotations

import asyncio

from sglang_lite.multimodal.attach import ImageAttacher
from sglang_lite.multimodal.inputs import ImageInputs
from sglang_lite.protocol.config import SchedulerConfig
from sglang_lite.server.io_struct import bad_request
from sglang_lite.server.model_name import served_model_name
from sglang_lite.server_args import ServerArgs


class ImageIntake:
    """Turns a request's image URLs and its rendered prompt into the prompt's ids and its ``ImageInputs``
    (``multimodal.attach``), a 400 naming the image on any refusal."""

    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.attacher = ImageAttacher(args)

    async def attach(
        self, ids: list[int], urls: list[str], config: SchedulerConfig
    ) -> tuple[list[int], ImageInputs]:
        """(the prompt's ids with each image placeholder expanded, the images), decoded on a worker thread."""
        if not config.image_merge_size:
            raise bad_request(
                f"images: the served model {served_model_name(self.args)!r} takes text only (its "
                "checkpoint has no vision tower)"
            )
        return await asyncio.to_thread(self._attach, ids, urls, config)

    def _attach(
        self, ids: list[int], urls: list[str], config: SchedulerConfig
    ) -> tuple[list[int], ImageInputs]:
        try:
            return self.attacher.attach(
                ids,
                urls,
                config.image_token_id,
                config.image_merge_size,
                config.vocab_size,
                prompt_name="messages",
            )
        except ValueError as error:
            raise bad_request(str(error)) from error
