"""Image input through ``/v1/chat/completions`` on a tiny random Qwen3.5-MoE VL checkpoint: the greedy text of one
and of two data-URL images equals transformers' ``generate`` on the same messages (logprobs within 1e-3); a remote
URL is refused without being fetched; a corrupt image is a 400 naming it and the server serves on; an image sent to
the text-only built-in model is a 400 naming the model."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import math
import os
from collections.abc import Iterator

import pytest
import requests
import torch
from PIL import Image
from transformers import AutoTokenizer, Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from sglang_lite.assets import TINY_MODEL_DIR
from tests.server.conftest import ServerProcess, start_server

SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
NEW_TOKENS = 8
# small images stay a few tokens: 32-pixel steps (patch 16, merge 2), at most 16 patches of 32 x 32
PREPROCESSOR = dict(
    patch_size=16,
    temporal_patch_size=2,
    merge_size=2,
    image_mean=[0.5, 0.5, 0.5],
    image_std=[0.5, 0.5, 0.5],
    size={"shortest_edge": 32 * 32, "longest_edge": 16 * 32 * 32},
)


def _template(tokenizer) -> str:
    """The built-in tokenizer's chat template, with an image part rendered as Qwen3.5's template renders it."""
    text_part = "{%- if part['type'] == 'text' %}{{- part['text'] }}"
    image_part = (
        "{%- elif part['type'] == 'image' or part['type'] == 'image_url' %}"
        "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    )
    assert text_part in tokenizer.chat_template
    return tokenizer.chat_template.replace(text_part, text_part + image_part)


@pytest.fixture(scope="module")
def vl_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("vl_checkpoint"))
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    tokenizer.chat_template = _template(tokenizer)
    tokenizer.save_pretrained(path)
    start, end, image, video = tokenizer.convert_tokens_to_ids(SPECIAL)
    text = dict(
        vocab_size=4104,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        eos_token_id=4095,
    )
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=16,
    )
    config = Qwen3_5MoeConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=image,
        video_token_id=video,
        vision_start_token_id=start,
        vision_end_token_id=end,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen3_5MoeForConditionalGeneration(config).eval()
    with torch.no_grad():  # norms and gates perturbed so that every weight matters
        for name, param in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(path)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump({"image_processor_type": "Qwen2VLImageProcessor", **PREPROCESSOR}, f)
    return path


@pytest.fixture(scope="module")
def vl_server(
    tmp_path_factory: pytest.TempPathFactory, vl_checkpoint: str
) -> Iterator[ServerProcess]:
    flags = ["--model-path", vl_checkpoint, "--load-format", "auto"]
    yield from start_server(tmp_path_factory, "vl", flags)


def _image(width: int, height: int, seed: int) -> Image.Image:
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def _data_url(image: Image.Image, kind: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=kind)
    return f"data:image/{kind.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def _transformers_greedy(
    path: str, question: str, images: list[Image.Image]
) -> tuple[str, list[float]]:
    """transformers on the messages as its processor prepares them: the template's text, each image placeholder
    repeated once per merged patch, the PIL image processor's pixels; greedy text and each token's logprob."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True
    )
    pixels = Qwen2VLImageProcessorPil(**PREPROCESSOR)(images, return_tensors="pt")
    for grid in pixels["image_grid_thw"].tolist():
        count = math.prod(grid) // PREPROCESSOR["merge_size"] ** 2
        text = text.replace("<|image_pad|>", "<|placeholder|>" * count, 1)
    text = text.replace("<|placeholder|>", "<|image_pad|>")
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    model = Qwen3_5MoeForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    image_id = model.config.image_token_id
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=pixels["pixel_values"],
            image_grid_thw=pixels["image_grid_thw"],
            mm_token_type_ids=(ids == image_id).int(),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    new = out.sequences[0, ids.shape[1] :]
    logprobs = [
        torch.log_softmax(score[0].float(), dim=-1)[token].item()
        for score, token in zip(out.scores, new.tolist())
    ]
    return tokenizer.decode(new, skip_special_tokens=True), logprobs


def _chat(server: ServerProcess, question: str, urls: list[str]) -> requests.Response:
    content = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    content.append({"type": "text", "text": question})
    body = {
        "model": "any",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": NEW_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": True,
    }
    return requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)


@pytest.mark.parametrize("sizes", [[(64, 96)], [(96, 64), (64, 64)]], ids=["one", "two"])
def test_images_greedy_equal_transformers(vl_server, vl_checkpoint, sizes):
    images = [_image(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    question = "What is in the picture?"
    want, want_logprobs = _transformers_greedy(vl_checkpoint, question, images)
    reply = _chat(vl_server, question, [_data_url(image) for image in images])
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["message"]["content"] == want
    got_logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    assert len(got_logprobs) == NEW_TOKENS
    assert max(abs(g - w) for g, w in zip(got_logprobs, want_logprobs)) < 1e-3


def test_image_tokens_carry_the_image_content():
    """The prefix cache keys on token ids: an image's tokens carry an id made from its content, so the same image
    gives the same ids and another image of the same size other ones."""
    from sglang_lite.multimodal.inputs import image_token

    vocab = 4104
    first, same, other = (hashlib.sha256(b).hexdigest() for b in (b"a", b"a", b"b"))
    assert image_token(first, vocab) == image_token(same, vocab) >= vocab
    assert image_token(first, vocab) != image_token(other, vocab)


def test_remote_url_is_refused_unfetched(vl_server):
    reply = _chat(vl_server, "What is this?", ["http://127.0.0.1:9/image.png"])
    assert reply.status_code == 400
    assert "--allow-remote-images" in reply.json()["error"]["message"]


def test_corrupt_image_is_a_400_naming_it_and_the_server_serves_on(vl_server):
    good = _data_url(_image(64, 64, seed=3))
    corrupt = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\nnot an image").decode()
    reply = _chat(vl_server, "Two pictures?", [good, corrupt])
    assert reply.status_code == 400
    assert "image 2" in reply.json()["error"]["message"]
    assert _chat(vl_server, "And this one?", [good]).status_code == 200


def test_image_to_a_text_only_model_names_the_model(server_dp1):
    reply = _chat(server_dp1, "What is this?", [_data_url(_image(64, 64, seed=1))])
    assert reply.status_code == 400
    message = reply.json()["error"]["message"]
    assert "takes text only" in message and "tiny" in message


@pytest.fixture(scope="module")
def vl_chunked_server(
    tmp_path_factory: pytest.TempPathFactory, vl_checkpoint: str
) -> Iterator[ServerProcess]:
    """Prefill chunks of 16 tokens: a chunk boundary falls inside an image, and the prefix cache keeps the state
    there (a snapshot at each chunk boundary)."""
    flags = ["--model-path", vl_checkpoint, "--load-format", "auto"]
    flags += ["--chunked-prefill-size", "16", "--enable-cache-report"]
    yield from start_server(tmp_path_factory, "vl-chunked", flags)


def test_prefix_cache_hits_the_same_image_and_not_another_of_its_size(
    vl_chunked_server, vl_checkpoint
):
    """The same image again is served from the cache up to the chunk boundary inside it (the vision tower then
    gives the rest of its tokens), with transformers' text; another image of the same size shares only the text
    before the images, which ends at no cached state."""
    question = "What is in the picture?"
    image, other = _image(128, 96, seed=20), _image(128, 96, seed=21)
    want, want_logprobs = _transformers_greedy(vl_checkpoint, question, [image])
    cached = []
    for picture in (image, image, other):
        reply = _chat(vl_chunked_server, question, [_data_url(picture)])
        assert reply.status_code == 200, reply.text
        body = reply.json()
        cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
        if picture is image:
            assert body["choices"][0]["message"]["content"] == want
            got = [entry["logprob"] for entry in body["choices"][0]["logprobs"]["content"]]
            assert max(abs(g - w) for g, w in zip(got, want_logprobs)) < 1e-3
    assert cached[0] == 0 and cached[1] >= 16 and cached[2] < 16, cached


def test_engine_takes_images_as_the_server_does(vl_checkpoint):
    """``Engine.generate(prompt, image_data=...)``: the prompt's text holds the placeholders (the chat template's
    rendering), the images come as data URLs or bare base64; the greedy text is transformers'."""
    from sglang_lite import Engine

    images = [_image(64, 96, seed=0)]
    question = "What is in the picture?"
    want, _ = _transformers_greedy(vl_checkpoint, question, images)
    tokenizer = AutoTokenizer.from_pretrained(vl_checkpoint)
    parts = [{"type": "image"}, {"type": "text", "text": question}]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True
    )
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
    bare = _data_url(images[0]).split(",", 1)[1]
    with Engine(vl_checkpoint, cpu_threads_per_rank=1) as engine:
        assert engine.generate(text, params, image_data=[_data_url(images[0])])["text"] == want
        assert engine.generate(text, params, image_data=bare)["text"] == want
        with pytest.raises(ValueError, match="1 image placeholder"):
            engine.generate(text, params, image_data=[bare, bare])
        with pytest.raises(ValueError, match="image 1"):
            engine.generate(text, params, image_data="data:image/png;base64,aGVsbG8=")
        assert engine.generate(text, params, image_data=bare)["text"] == want
