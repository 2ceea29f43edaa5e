"""A request's images as they travel from the front end to its rank, and how their tokens sit in the prompt.

The front end decodes and preprocesses the images (``media``, ``image_processor``) and expands each image's
placeholder into one token per merged patch. Those tokens do not carry the checkpoint's image token id: each
image's tokens carry an id of its own above the vocabulary, made from a hash of the image's content
(``image_token``), so that the prefix cache, which keys on token ids, hits for the same image and misses for another
image of the same size, as SGLang pads image tokens with a hash of their data. The model never looks these ids up in
its embedding: the vision tower's output replaces those rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Ids of image tokens lie in [vocab_size, vocab_size + IMAGE_ID_SPAN).
IMAGE_ID_SPAN = 1 << 30


def image_token(content_hash: str, vocab_size: int) -> int:
    """The prompt id of every token of the image whose content hash (hex) is ``content_hash``."""
    return vocab_size + int(content_hash[:15], 16) % IMAGE_ID_SPAN


@dataclass(frozen=True)
class ImageInputs:
    """Every image of one request, in prompt order: the vision tower's input ``pixel_values`` [N, D] float32 (the
    patches of image 0, then image 1, ...; numpy, so that the front end's messages need no torch), each image's
    patch grid (t, h, w) and its content hash (hex)."""

    pixel_values: np.ndarray
    grid_thw: tuple[tuple[int, int, int], ...]
    hashes: tuple[str, ...]

    def token_counts(self, merge_size: int) -> list[int]:
        """Each image's tokens in the prompt: one per merge_size x merge_size patches."""
        return [t * h * w // (merge_size * merge_size) for t, h, w in self.grid_thw]

    def to_wire(self) -> list:
        values = np.ascontiguousarray(self.pixel_values, dtype=np.float32)
        grid = [list(g) for g in self.grid_thw]
        return [values.tobytes(), list(values.shape), grid, list(self.hashes)]

    @classmethod
    def from_wire(cls, values: list | None) -> ImageInputs | None:
        if values is None:
            return None
        data, shape, grid, hashes = values
        array = np.frombuffer(data, dtype=np.float32).reshape(shape)
        return cls(array, tuple(tuple(g) for g in grid), tuple(hashes))

    def check(self, input_ids: list[int], vocab_size: int, merge_size: int) -> None:
        """Raises ValueError unless the prompt holds each image's tokens, in order, as one run of its id."""
        if len(self.grid_thw) != len(self.hashes) or not self.grid_thw:
            raise ValueError("images: one grid and one hash per image are required")
        patches = sum(t * h * w for t, h, w in self.grid_thw)
        if self.pixel_values.ndim != 2 or self.pixel_values.shape[0] != patches:
            raise ValueError(
                f"images: pixel_values must hold {patches} patches, got {tuple(self.pixel_values.shape)}"
            )
        runs = image_runs(input_ids, vocab_size)
        want = [
            (image_token(h, vocab_size), n)
            for h, n in zip(self.hashes, self.token_counts(merge_size))
        ]
        if [(token, end - start) for token, start, end in runs] != want:
            raise ValueError(
                f"input_ids: the prompt's image tokens do not match its {len(want)} image(s)"
            )


def image_runs(input_ids: list[int], vocab_size: int) -> list[tuple[int, int, int]]:
    """(id, start, end) of each run of one image's tokens in the prompt."""
    ids = np.asarray(input_ids, dtype=np.int64)
    marks = np.flatnonzero(ids >= vocab_size)
    runs: list[tuple[int, int, int]] = []
    for i in marks.tolist():
        if runs and runs[-1][2] == i and runs[-1][0] == input_ids[i]:
            runs[-1] = (runs[-1][0], runs[-1][1], i + 1)
        else:
            runs.append((input_ids[i], i, i + 1))
    return runs
