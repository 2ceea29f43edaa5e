"""A prompt's images as a rank takes them, for every front end (the HTTP server, the ``Engine``): each URL decoded
(``media.load_image`` under the front end's ``MediaPolicy``), preprocessed by the checkpoint's image processor
(read at the first image), and the prompt's placeholders expanded into one token per merged patch, each image's
tokens carrying an id of its own (``inputs.image_token``: the prefix cache tells images apart by it). Every refusal
is a ``ValueError`` naming the image (``ImageInputError``) or the prompt's placeholders."""

from __future__ import annotations

from typing import Any

import numpy as np

from sglang_lite.multimodal.inputs import ImageInputs, image_token
from sglang_lite.multimodal.media import ImageInputError, MediaPolicy, load_image
from sglang_lite.server_args import ServerArgs


class ImageAttacher:
    """``args``: the front end's server arguments (``--allow-remote-images``, and the checkpoint whose image
    processor is read at the first image)."""

    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.policy = MediaPolicy(allow_remote=args.allow_remote_images)
        self._processor: Any = None

    def attach(
        self,
        ids: list[int],
        urls: list[str],
        image_token_id: int,
        merge_size: int,
        vocab_size: int,
        prompt_name: str = "prompt",
    ) -> tuple[list[int], ImageInputs]:
        """(``ids`` with each ``image_token_id`` placeholder expanded, the images); ``prompt_name``: what the
        placeholder count's refusal names (the chat ``messages`` on the HTTP side)."""
        loaded = [load_image(url, i + 1, self.policy) for i, url in enumerate(urls)]
        processed = []
        for number, image in enumerate(loaded, start=1):
            try:  # one at a time (the same rows as all at once): a refusal names its image
                processed.append(self.processor()([image.image]))
            except ValueError as error:  # an aspect ratio the resize rules refuse
                raise ImageInputError(number, str(error)) from error
        pixels = np.concatenate([p.pixel_values.numpy() for p in processed])
        grids = tuple(tuple(int(v) for v in p.grid_thw[0].tolist()) for p in processed)
        images = ImageInputs(pixels, grids, tuple(image.content_hash for image in loaded))
        placeholders = [i for i, token in enumerate(ids) if token == image_token_id]
        if len(placeholders) != len(urls):
            raise ValueError(
                f"{prompt_name}: holds {len(placeholders)} image placeholder(s) for {len(urls)} image(s)"
            )
        expanded: list[int] = []
        start = 0
        counts = images.token_counts(merge_size)
        for at, count, content in zip(placeholders, counts, images.hashes):
            expanded += ids[start:at] + [image_token(content, vocab_size)] * count
            start = at + 1
        return expanded + ids[start:], images

    def processor(self) -> Any:
        if self._processor is None:
            from sglang_lite.multimodal.image_processor import ImageProcessor

            self._processor = ImageProcessor.from_pretrained(self.args.model_dir)
        return self._processor
