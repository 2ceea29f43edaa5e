"""Images in requests, on the HTTP side: decoded (``multimodal.media``: data URLs, remote ones only with
``--allow-remote-images``), preprocessed for the vision tower (``multimodal.image_processor``), and their
placeholders in the rendered prompt expanded into one token per merged patch, each image's tokens carrying an id of
its own (``multimodal.inputs.image_token``: the prefix cache tells images apart by it).

Every failure is the request's fault and a 400 naming the image: a URL the policy refuses (never fetched), bytes
that are no image, an image past the size limits, an image sent to a model without a vision tower.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from sglang_lite.multimodal.inputs import ImageInputs, image_token
from sglang_lite.protocol.config import SchedulerConfig
from sglang_lite.server.io_struct import bad_request
from sglang_lite.server.model_name import served_model_name
from sglang_lite.server_args import ServerArgs


class ImageIntake:
    """Turns a request's image URLs and its rendered prompt into the prompt's ids and its ``ImageInputs``."""

    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self._processor: Any = None  # read from the checkpoint at the first image

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
        from sglang_lite.multimodal.media import ImageInputError, MediaPolicy, load_image

        policy = MediaPolicy(allow_remote=self.args.allow_remote_images)
        try:
            loaded = [load_image(url, i + 1, policy) for i, url in enumerate(urls)]
        except ImageInputError as error:
            raise bad_request(str(error)) from error
        processed = []
        for number, image in enumerate(loaded, start=1):
            try:  # one at a time (the same rows as all at once): a refusal names its image
                processed.append(self.processor()([image.image]))
            except ValueError as error:  # an aspect ratio the resize rules refuse
                raise bad_request(f"image {number}: {error}") from error
        pixels = np.concatenate([p.pixel_values.numpy() for p in processed])
        grids = tuple(tuple(int(v) for v in p.grid_thw[0].tolist()) for p in processed)
        images = ImageInputs(pixels, grids, tuple(image.content_hash for image in loaded))
        placeholders = [i for i, token in enumerate(ids) if token == config.image_token_id]
        if len(placeholders) != len(urls):
            raise bad_request(
                f"messages: the chat template rendered {len(placeholders)} image placeholder(s) for "
                f"{len(urls)} image(s)"
            )
        counts = images.token_counts(config.image_merge_size)
        expanded: list[int] = []
        start = 0
        for at, count, content in zip(placeholders, counts, images.hashes):
            expanded += ids[start:at] + [image_token(content, config.vocab_size)] * count
            start = at + 1
        expanded += ids[start:]
        return expanded, images

    def processor(self) -> Any:
        if self._processor is None:
            from sglang_lite.multimodal.image_processor import ImageProcessor

            self._processor = ImageProcessor.from_pretrained(self.args.model_dir)
        return self._processor
