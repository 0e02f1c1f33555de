"""Images in: Gemma 3's tower and projector against transformers, images in prompts, the prefix cache, hostile files.

Expected values are transformers' (tests/fixtures/make_tiny_vision.py wrote them: Gemma3ImageProcessorPil's
pixel_values, Gemma3ForConditionalGeneration's logits and greedy tokens on real images) or Pillow's own decoding.
"""

from __future__ import annotations

import base64
import io
import json
import shutil
import struct
import zlib
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image
from safetensors import safe_open

import mlxinfer
from mlxinfer.cache import make_cache
from mlxinfer.engine import Prefill, encode_chat
from mlxinfer.errors import ImageError
from mlxinfer.vision import Layout, Limits, processor_from_folder, read_image, read_images
from tests.conftest import TINY

MODEL = TINY / "gemma3_vision"
IMAGES = Path(__file__).parent / "fixtures" / "images"
# The golden cases' messages (make_tiny_vision.CASES), images by file.
CASES = {
    "portrait": [{"type": "image", "image": "hopper.jpg"}, {"type": "text", "text": "Who is this?"}],
    "two": [
        {"type": "text", "text": "Compare "},
        {"type": "image", "image": "hopper_wide.png"},  # a palette PNG
        {"type": "text", "text": " with "},
        {"type": "image", "image": "hopper_small.png"},  # a translucent RGBA PNG, upscaled
        {"type": "text", "text": ", please."},
    ],
}


def messages(case: str) -> list[dict]:
    parts = [{**p, "image": str(IMAGES / p["image"])} if p["type"] == "image" else p for p in CASES[case]]
    return [{"role": "user", "content": parts}]


def golden(case: str, key: str, family: str = "gemma3_vision") -> np.ndarray:
    return np.array(FAMILY_GOLDEN[family][f"{case}.{key}"])


# Each family with images, its fixture's transformers outputs: Gemma 3 (one frame an image, bidirectional within it)
# SmolVLM (tiles by the image's size, each a frame; causal), also under its v1 name Idefics3, Mistral 3 (one
# frame an image, in its own shape; a run of tokens a row), Gemma 4 (bidirectional in its sliding layers), Qwen3.5
# (sized by pixels; M-RoPE: image tokens at 2-D positions; also with its MoE text model) and Qwen3-VL (the same, and
# deepstack features added in its first two layers), and LFM2-VL (tiles and a thumbnail, or one frame; a SigLIP2 NaFlex
# tower). The same cases and images for all.
FAMILIES = ["gemma3_vision", "smolvlm", "idefics3", "mistral3", "gemma4_vision", "qwen3_5_vision", "qwen3_5_moe_vision",
            "qwen3_vl_vision", "lfm2_vl"]  # fmt: skip
FAMILY_GOLDEN = {name: mx.load(str(TINY / name / "golden_image.safetensors")) for name in FAMILIES}
# LFM2-VL's processor has no Pillow version in transformers: torchvision resizes, and rounds some values of a scaled
# frame one 8-bit step away from Pillow (up to 3% of a thumbnail's). Its pixel values hold to that step, and its logits
# to what the step moves them (0.047 at most here); given transformers' pixel values they hold to the text bound
# (test_lfm2_vl_reads_transformers_pixel_values_as_transformers_does).
PIXEL_TOLERANCE = {"lfm2_vl": 2 / 255 + 1e-6}
LOGIT_TOLERANCE = {"lfm2_vl": 0.06}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> tuple[str, mlxinfer.Model]:
    return request.param, mlxinfer.load(TINY / request.param, prefix_cache_bytes=0)


@pytest.fixture(scope="module")
def gemma() -> mlxinfer.Model:
    return mlxinfer.load(MODEL, prefix_cache_bytes=64 << 20)


@pytest.fixture(scope="module")
def qwen() -> mlxinfer.Model:
    return mlxinfer.load(TINY / "qwen3_5_vision", prefix_cache_bytes=64 << 20)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("case", CASES)
def test_pixel_values_match_transformers(name, case):
    # SmolVLM: the portrait and the tiny RGBA PNG are 2 x 2 tiles and the whole (5 frames), the wide one 1 x 2 (3).
    # Mistral 3: each image keeps its shape (64 x 56, 32 x 64, 16 x 24); transformers pads them to one batch.
    # LFM2-VL: the portrait is 2 x 2 tiles and a 32 x 24 thumbnail, the wide one 1 x 2 and 16 x 40, the tiny one
    # 16 x 16.
    model = mlxinfer.load(TINY / name, prefix_cache_bytes=0)
    files = [p["image"] for p in CASES[case] if p["type"] == "image"]
    expected, at = golden(case, "pixel_values", name), 0
    for file in files:
        for frame in model.vision.processor.frames(read_image(IMAGES / file)):
            _, height, width = frame.shape
            np.testing.assert_allclose(frame, expected[at, :, :height, :width], atol=PIXEL_TOLERANCE.get(name, 1e-6))
            assert not expected[at, :, height:].any() and not expected[at, ..., width:].any()
            at += 1
    assert at == len(expected)


@pytest.mark.parametrize(("case", "chunk"), [("portrait", 64), ("two", 64), ("two", 3)])
def test_logits_of_every_position_match_transformers(family, case, chunk):
    # Chunks of 3 would cut each 4-token frame: it runs whole instead (placed whole; Gemma 3's tokens also attend to
    # each other both ways), and the text past Gemma's 8-token sliding window reads the images from the cache.
    name, model = family
    ids, images = encode_chat(model.tokenizer, model.vision, messages(case), model.context_tokens)
    assert ids == golden(case, "input_ids", name).tolist()
    decoder = model._loaded.model
    run = Prefill.start(decoder, make_cache(decoder.cache_kinds), mx.array(ids, dtype=mx.uint32), chunk, images=images)
    hidden = [run.step()]
    while not run.finished:
        hidden.append(run.step())
    logits = np.array(decoder.head(mx.concatenate(hidden, axis=1))[0])
    # The text tests' bound (test_parity.py). Gemma 4's tower agrees with transformers' to 1e-5, which its tiny
    # random text model turns into up to 2e-4 at the logits; given transformers' image features it agrees to 3e-5.
    np.testing.assert_allclose(logits, golden(case, "logits", name), atol=LOGIT_TOLERANCE.get(name, 1e-3))


def test_gemma3_pan_and_scan_crops_and_prompts_as_transformers_does(tmp_path):
    """With do_pan_and_scan on: a wide image is the whole and 2 crops, a tall strip the whole and 4, the portrait the
    whole alone (under the 1.2 ratio); pixel values, prompt ids and every position's logits are transformers'
    (make_tiny_vision.gemma3_pan_and_scan)."""
    folder = tmp_path / "gemma3_pan_and_scan"
    shutil.copytree(MODEL, folder)
    settings = json.loads((folder / "preprocessor_config.json").read_text())
    settings |= {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 16, "pan_and_scan_max_num_crops": 4}
    (folder / "preprocessor_config.json").write_text(json.dumps(settings))
    model = mlxinfer.load(folder, prefix_cache_bytes=0)
    expected = mx.load(str(MODEL / "golden_pan_and_scan.safetensors"))
    files = ["hopper_wide.png", "hopper_strip.png", "hopper.jpg"]
    frames = [f for file in files for f in model.vision.processor.frames(read_image(IMAGES / file))]
    np.testing.assert_allclose(np.stack(frames), np.array(expected["pan.pixel_values"]), atol=1e-6)
    parts = [{"type": "text", "text": "Compare "}, {"type": "image", "image": str(IMAGES / files[0])},
             {"type": "text", "text": " and "}, {"type": "image", "image": str(IMAGES / files[1])},
             {"type": "text", "text": " with "}, {"type": "image", "image": str(IMAGES / files[2])}]  # fmt: skip
    ids, images = encode_chat(model.tokenizer, model.vision, [{"role": "user", "content": parts}], 1024)
    assert ids == np.array(expected["pan.input_ids"]).tolist()
    decoder = model._loaded.model
    run = Prefill.start(decoder, make_cache(decoder.cache_kinds), mx.array(ids, dtype=mx.uint32), 64, images=images)
    hidden = [run.step()]
    while not run.finished:
        hidden.append(run.step())
    logits = np.array(decoder.head(mx.concatenate(hidden, axis=1))[0])
    np.testing.assert_allclose(logits, np.array(expected["pan.logits"]), atol=1e-3)


def test_pan_and_scan_cuts_every_size_as_transformers_does():
    """PanAndScan.crops against Gemma3ImageProcessorPil.pan_and_scan itself, on sizes around each of its rules (the
    ratio's threshold, half-up rounding, the crop count's bounds, a crop under the minimum) and a random sample."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from mlxinfer.vision.pan_and_scan import PanAndScan

    reference, ours = Gemma3ImageProcessorPil(), PanAndScan(min_crop=16, max_crops=4, min_ratio=1.2)
    sizes = [(96, 48), (24, 96), (100, 100), (119, 100), (120, 100), (130, 50), (50, 130), (200, 10), (40, 16),
             (31, 16), (33, 16), (250, 40)]  # fmt: skip
    sizes += [tuple(s) for s in np.random.default_rng(0).integers(8, 300, size=(40, 2)).tolist()]
    for width, height in sizes:
        image = (np.arange(height * width * 3) % 251).astype(np.uint8).reshape(height, width, 3)
        theirs = reference.pan_and_scan(image.transpose(2, 0, 1), 16, 4, 1.2)
        crops = ours.crops(image)
        assert [c.transpose(2, 0, 1).tolist() for c in crops] == [t.tolist() for t in theirs], (width, height)
        rows, cols = ours.grid(width, height)
        assert rows * cols == len(theirs)


def test_lfm2_vl_reads_transformers_pixel_values_as_transformers_does(monkeypatch):
    # Each frame ours in size, transformers' in value: the logits then hold to the text bound (1.7e-5 measured).
    from mlxinfer.vision import TileProcessor

    model = mlxinfer.load(TINY / "lfm2_vl", prefix_cache_bytes=0)
    real = TileProcessor.frames
    for case in CASES:
        given = iter(golden(case, "pixel_values", "lfm2_vl"))

        def transformers_values(self, rgb, given=given):
            return [next(given)[:, : f.shape[1], : f.shape[2]] for f in real(self, rgb)]

        monkeypatch.setattr(TileProcessor, "frames", transformers_values)
        ids, images = encode_chat(model.tokenizer, model.vision, messages(case), model.context_tokens)
        decoder = model._loaded.model
        run = Prefill.start(
            decoder, make_cache(decoder.cache_kinds), mx.array(ids, dtype=mx.uint32), 512, images=images
        )
        hidden = [run.step()]
        while not run.finished:  # a frame's tower a step
            hidden.append(run.step())
        logits = np.array(decoder.head(mx.concatenate(hidden, axis=1))[0])
        np.testing.assert_allclose(logits, golden(case, "logits", "lfm2_vl"), atol=1e-3)


@pytest.mark.parametrize("size", [2, 3, 7, 16, 24])
def test_naflex_positions_resize_as_torchs_antialiased_bilinear(size):
    # LFM2-VL's fixture never shrinks its 4 x 4 grid (every frame is at least 4 patches a side); real frames can be
    # narrower than the real 16 x 16 grid, where the antialiasing decides. The reference: torch resizing the identity.
    torch = pytest.importorskip("torch")
    from mlxinfer.models.siglip import _antialiased

    identity = torch.eye(16)[None, None]
    resized = torch.nn.functional.interpolate(identity, size=(size, 16), mode="bilinear", align_corners=False,
                                              antialias=True)[0, 0]  # fmt: skip
    np.testing.assert_allclose(_antialiased(size, 16), resized.numpy(), atol=1e-6)


def test_the_tower_runs_while_a_request_is_prepared_and_a_prefill_step_embeds_one_frame_at_most():
    # SmolVLM's portrait is 5 frames in a 64-token prompt. They are embedded while the request is prepared (on a
    # device thread), so its prefill runs no tower; a frame evicted before its prefill is embedded there, one a step:
    # one 512-token chunk would run the tower 5 times, holding every other request's decode for all of it.
    model = mlxinfer.load(TINY / "smolvlm", prefix_cache_bytes=0)
    decoder, calls, hidden = model._loaded.model, [], []
    tower = type(model.vision).__call__
    try:
        type(model.vision).__call__ = lambda self, pixels: calls.append(len(hidden)) or tower(self, pixels)
        ids, images = encode_chat(model.tokenizer, model.vision, messages("portrait"), model.context_tokens)
        assert len(calls) == 5 and all(model.vision.has((s.digest, s.frame)) for s in images.spans)
        calls.clear()
        for kept in (True, False):
            if not kept:
                model.vision._kept.clear()  # as if later requests' frames had pushed these out
            hidden = []
            run = Prefill.start(decoder, make_cache(decoder.cache_kinds), mx.array(ids, dtype=mx.uint32), 512,
                                images=images)  # fmt: skip
            while not run.finished:
                hidden.append(run.step())
            assert (calls, len(hidden)) == (([], 1) if kept else ([0, 1, 2, 3, 4], 6))
    finally:
        type(model.vision).__call__ = tower
    logits = np.array(decoder.head(mx.concatenate(hidden, axis=1))[0])
    np.testing.assert_allclose(logits, golden("portrait", "logits", "smolvlm"), atol=1e-4)


def test_kept_frames_are_bounded_by_their_bytes_as_well_as_their_count(monkeypatch):
    from mlxinfer.models import vision as vision_module

    vision = mlxinfer.load(TINY / "smolvlm", prefix_cache_bytes=0).vision
    frames = vision.processor.frames(read_image(IMAGES / "hopper.jpg"))  # 5 frames
    monkeypatch.setattr(vision_module, "KEPT_BYTES", 2 * vision.features((b"x", 0), frames[0]).nbytes)
    for i in range(1, 5):
        vision.features((b"x", i), frames[i])
    assert list(vision._kept) == [(b"x", 3), (b"x", 4)]  # the newest two fit


def test_each_family_answers_about_images_as_transformers_does(family):
    name, model = family
    for case in CASES:
        assert model.chat(messages(case), max_tokens=8).token_ids == golden(case, "greedy", name).tolist()


def test_chat_and_generate_answer_as_transformers_does(gemma):
    chat = gemma.chat(messages("portrait"), max_tokens=8, use_cache=False)
    assert chat.token_ids == golden("portrait", "greedy").tolist()
    # Images given as bytes and as an array answer as their files do.
    sources = iter([(IMAGES / "hopper_wide.png").read_bytes(), np.asarray(Image.open(IMAGES / "hopper_small.png"))])
    parts = [{"type": "image", "image": next(sources)} if p["type"] == "image" else p for p in CASES["two"]]
    two = gemma.chat([{"role": "user", "content": parts}], max_tokens=8, use_cache=False)
    assert two.token_ids == golden("two", "greedy").tolist()


def test_a_raw_prompt_places_images_at_their_placeholders_else_first(gemma):
    # Gemma3Processor's full_image_sequence: "\n\n<start_of_image>" + 4 x <image_soft_token> + "<end_of_image>\n\n"
    image = [10, 10, 260, 259, 259, 259, 259, 261, 10, 10]
    ask = list(b"Who?")
    at = gemma.generate("Who?<start_of_image>", images=[IMAGES / "hopper.jpg"], max_tokens=1)
    first = gemma.generate("Who?", images=[IMAGES / "hopper.jpg"], max_tokens=1)
    assert at.stats.prompt_tokens == len(ask + image)
    assert gemma._encode_images("Who?<start_of_image>", None, [IMAGES / "hopper.jpg"])[0] == ask + image
    assert gemma._encode_images("Who?", None, [IMAGES / "hopper.jpg"])[0] == image + ask
    assert first.stats.prompt_tokens == len(image + ask)


def test_the_prefix_cache_keys_an_image_by_its_content(gemma):
    # Two prompts with the same text and different images have the same token ids: keyed by ids, the second would
    # resume from the first's snapshot before its end, on the wrong picture's keys and values.
    gemma.prefix_cache.clear()
    asked = gemma.chat(messages("portrait"), max_tokens=4)
    ids = golden("portrait", "input_ids").tolist()
    image_start = ids.index(259)
    calls = []
    tower = type(gemma.vision).__call__
    type(gemma.vision).__call__ = lambda self, pixels: calls.append(1) or tower(self, pixels)
    try:
        again = gemma.chat(messages("portrait"), max_tokens=4)  # the same image: resumed, the tower not run
        assert again.stats.cached_tokens == len(ids) - 1 and calls == []
        follow_up = [*messages("portrait"), {"role": "assistant", "content": asked.text}]
        follow_up.append({"role": "user", "content": "And now?"})
        later = gemma.chat(follow_up, max_tokens=4)
        assert later.stats.cached_tokens >= ids.index(258) + 1 and calls == []  # past the first turn's end
        other = messages("portrait")
        mirrored = np.asarray(Image.open(IMAGES / "hopper.jpg"))[:, ::-1]  # a picture no earlier test embedded
        other[0]["content"][0] = {"type": "image", "image": mirrored}
        third = gemma.chat(other, max_tokens=4)
        assert third.stats.cached_tokens <= image_start and calls == [1]
    finally:
        type(gemma.vision).__call__ = tower
    assert third.token_ids == gemma.chat(other, max_tokens=4, use_cache=False).token_ids


def test_structured_output_and_speculation_work_on_image_requests(gemma):
    plain = gemma.chat(messages("portrait"), max_tokens=40, speculate="off", use_cache=False)
    drafted = gemma.chat(messages("portrait"), max_tokens=40, speculate="lookup", use_cache=False)
    assert drafted.token_ids == plain.token_ids and drafted.stats.drafted_tokens > 0
    # Unconstrained, this model answers bytes that are no text; held to one choice, it writes exactly that.
    chosen = gemma.chat(messages("portrait"), choices=["a woman"], max_tokens=8, use_cache=False)
    assert (chosen.text, chosen.finish_reason) == ("a woman", "stop") and plain.text != "a woman"


def test_qwen_image_tokens_take_the_positions_transformers_gives_them(qwen):
    # Each image's tokens at (start, start + row, start + col), the text after it from its start plus its longer
    # side: the portrait (8 x 7 tokens) moves what follows back by 48, the two images by 44 and 2.
    for case in CASES:
        ids, images = encode_chat(qwen.tokenizer, qwen.vision, messages(case), qwen.context_tokens)
        expected = golden(case, "positions", "qwen3_5_vision")
        np.testing.assert_array_equal(np.array(images.positions(0, len(ids))), expected)
        after = images.spans[0].end  # a chunk that starts past the first image
        np.testing.assert_array_equal(np.array(images.positions(after, len(ids))), expected[:, after:])
        # Decoding goes on where transformers' rope_deltas put it: one past the largest position.
        assert len(ids) + images.rope_shift(len(ids)) == expected.max() + 1


def test_a_qwen_follow_up_resumes_past_its_images_at_their_shifted_positions(qwen):
    first = qwen.chat(messages("two"), max_tokens=4)
    follow_up = [*messages("two"), {"role": "assistant", "content": first.text}, {"role": "user", "content": "Why?"}]
    resumed = qwen.chat(follow_up, max_tokens=8)
    ids = golden("two", "input_ids", "qwen3_5_vision").tolist()
    assert resumed.stats.cached_tokens >= ids.index(258) + 1  # past the first turn, images and all
    assert resumed.token_ids == qwen.chat(follow_up, max_tokens=8, use_cache=False).token_ids


def test_qwen_verifies_drafts_at_its_image_shifted_positions(monkeypatch):
    # A draft model would read the image tokens as text (it has no tower), so an image prompt drafts by lookup, and
    # says why. Drafts of any kind are verified at the row's shifted positions: forced to draft with the model here
    # (it drafts wrong often), each rejection rewinds the target's recurrent layers and feeds them again.
    from mlxinfer.engine import speculation

    model = mlxinfer.load(TINY / "qwen3_5_vision", draft_model=TINY / "qwen3_5_vision", prefix_cache_bytes=0)
    declined = model.chat(messages("two"), max_tokens=4, speculate="draft", use_cache=False)
    assert (declined.stats.speculation, declined.stats.draft_declined) == ("lookup", speculation.DRAFT_IMAGES)
    text_only = speculation.uses_draft_model
    monkeypatch.setattr(speculation, "uses_draft_model", lambda *args, images, **kw: text_only(*args, **kw))
    drafted = model.chat(messages("two"), max_tokens=24, speculate="draft", use_cache=False)
    plain = model.chat(messages("two"), max_tokens=24, speculate="off", use_cache=False)
    assert (
        drafted.token_ids == plain.token_ids
        and drafted.token_ids[:8] == golden("two", "greedy", "qwen3_5_vision").tolist()
    )
    assert drafted.stats.drafted_tokens > drafted.stats.accepted_tokens > 0


@pytest.mark.parametrize("name", ["gemma3_vision", "qwen3_5_vision"])
def test_rows_with_and_without_images_decode_in_one_batch_as_each_alone(name, scheduler_for, request):
    # Qwen3.5's rows decode at positions their images shifted, each its own (the portrait's by -48, the two's by -46).
    from mlxinfer.engine import Job
    from tests.test_scheduler import Collector, batch_sizes

    gemma = request.getfixturevalue("gemma" if name == "gemma3_vision" else "qwen")
    asks = [messages("portrait"), [{"role": "user", "content": "Who is this?"}], messages("two")]
    alone = [gemma.chat(m, max_tokens=8, use_cache=False).token_ids for m in asks]
    scheduler = scheduler_for(gemma, max_batch=3, prefill_chunk=16)
    sizes = batch_sizes(scheduler)
    collectors = [Collector() for _ in asks]
    for ask, collector in zip(asks, collectors):
        ids, images = encode_chat(gemma.tokenizer, gemma.vision, ask, gemma.context_tokens)
        scheduler.submit(Job(ids, collector, max_tokens=8, images=images, use_cache=False))
    together = [c.wait() for c in collectors]
    assert max(sizes) >= 2
    assert [gemma.tokenizer.encode("".join(c.texts), add_special_tokens=False) for c in together] == [
        gemma.tokenizer.encode(gemma.tokenizer.decode(ids), add_special_tokens=False) for ids in alone
    ]
    assert (
        alone[0] == golden("portrait", "greedy", name).tolist() and alone[2] == golden("two", "greedy", name).tolist()
    )


def test_the_towers_activations_are_counted_before_a_request_starts(gemma, scheduler_for, monkeypatch):
    from mlxinfer.engine import Failed, Job
    from mlxinfer.errors import MemoryBudgetError
    from tests.test_scheduler import Collector

    ids, images = encode_chat(gemma.tokenizer, gemma.vision, messages("portrait"), gemma.context_tokens)
    assert images.activation_bytes == gemma.vision.activation_bytes(1) > 0
    scheduler = scheduler_for(gemma)
    for tower_bytes, refused in ((0, False), (1 << 50, True)):  # a petabyte of activations: never fits
        monkeypatch.setattr(type(gemma.vision), "activation_bytes", lambda self, frames, b=tower_bytes: b)
        collector = Collector()
        scheduler.submit(Job(ids, collector, max_tokens=2, images=images, use_cache=False))
        end = collector.wait().end
        assert isinstance(end, Failed) == refused
        assert not refused or isinstance(end.error, MemoryBudgetError)


def test_a_warmed_image_prefix_is_kept_on_disk_and_resumed_after_a_restart():
    look = [
        {
            "role": "user",
            "content": [{"type": "image", "image": str(IMAGES / "hopper_wide.png")}, {"type": "text", "text": "Look."}],
        }
    ]
    warmed = mlxinfer.load(MODEL).warm(look)
    restarted = mlxinfer.load(MODEL)  # a new process would find the same file: nothing is in memory yet
    towered, embed_ahead = [], restarted.vision.embed_ahead
    restarted.vision.embed_ahead = lambda frames: towered.append(len(frames)) or embed_ahead(frames)
    follow_up = [*look, {"role": "assistant", "content": "Yes."}, {"role": "user", "content": "Who?"}]
    resumed = restarted.chat(follow_up, max_tokens=2)
    assert resumed.stats.cached_tokens == warmed and towered == [0]  # the image's KV came from disk: no tower run
    assert resumed.token_ids == restarted.chat(follow_up, max_tokens=2, use_cache=False).token_ids
    assert towered == [0, 1]  # the same request without the cache runs its frame
    other = [
        {
            "role": "user",
            "content": [{"type": "image", "image": str(IMAGES / "hopper.jpg")}, {"type": "text", "text": "Look."}],
        }
    ]
    assert restarted.chat([*other, *follow_up[1:]], max_tokens=2).stats.cached_tokens == 0


def test_images_for_a_text_model_and_mismatched_placeholders_are_refused(gemma, tiny_llama):
    with pytest.raises(ImageError, match="does not read images"):
        tiny_llama.chat([{"role": "user", "content": [{"type": "image", "image": str(IMAGES / "hopper.jpg")}]}])
    with pytest.raises(ImageError, match="has 2 <start_of_image> but 1 images were given"):
        gemma.generate("<start_of_image> and <start_of_image>", images=[IMAGES / "hopper.jpg"])


# ---- hostile images: one clear error or a correct result, bounded before decoding ----


def png_bytes(image: Image.Image, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, format=options.pop("format", "PNG"), **options)
    return out.getvalue()


def with_stated_size(png: bytes, width: int, height: int) -> bytes:
    """A PNG whose header claims another size (its CRC fixed): a decompression bomb's header."""
    header = b"IHDR" + struct.pack(">II", width, height) + png[24:29]
    return png[:12] + header + struct.pack(">I", zlib.crc32(header)) + png[33:]


def test_hostile_images_are_refused_in_one_line():
    small = png_bytes(Image.new("RGB", (4, 4), "red"))
    cases = {
        "states more than": with_stated_size(small, 100_000, 100_000),
        "truncated or corrupt": (IMAGES / "hopper.jpg").read_bytes()[:2000] + b"\0" * 10,
        "not an image in a supported format": b"GIF87a? not really" + b"\0" * 64,
        "SVG images are not supported": b'<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg"/>',
        "TIFF": png_bytes(Image.new("RGB", (4, 4)), format="TIFF"),
    }
    for expected, data in cases.items():
        expected = "not an image in a supported format" if expected == "TIFF" else expected
        with pytest.raises(ImageError, match=expected) as error:
            read_image(data, "messages[0].content[1]")
        assert str(error.value).startswith("messages[0].content[1]: ") and "\n" not in str(error.value)
    with pytest.raises(ImageError, match="20x20 pixels, more than the 100 allowed"):
        read_image(Image.new("RGB", (20, 20)), limits=Limits(max_pixels=100))
    with pytest.raises(ImageError, match="not valid base64"):
        read_image("data:image/png;base64,@@@")
    with pytest.raises(ImageError, match="holds 'text/html', not an image"):
        read_image("data:text/html;base64," + base64.b64encode(small).decode())


def test_request_limits_hold_before_images_are_read():
    never_read = [(f"images[{i}]", "/nonexistent/never-read.png") for i in range(3)]
    with pytest.raises(ImageError, match="3 images in one request; at most 2"):
        read_images(never_read, Limits(max_images=2))
    tile = Image.new("RGB", (10, 10))
    with pytest.raises(ImageError, match=r"images\[1\]: with it the request's images are more than the 150 pixels"):
        read_images([("images[0]", tile), ("images[1]", tile)], Limits(max_total_pixels=150))


def test_odd_modes_read_as_transformers_would_or_correctly():
    photo = Image.open(IMAGES / "hopper.jpg").resize((40, 30))
    rgb = np.asarray(photo)
    # CMYK JPEG: Pillow's own conversion, as transformers' convert_rgb gives.
    cmyk = read_image(png_bytes(photo.convert("CMYK"), format="JPEG", quality=95))
    np.testing.assert_array_equal(
        cmyk,
        np.asarray(Image.open(io.BytesIO(png_bytes(photo.convert("CMYK"), format="JPEG", quality=95))).convert("RGB")),
    )
    # EXIF orientation 6 (rotate 90 clockwise to view): read upright.
    exif = Image.Exif()
    exif[0x0112] = 6
    turned = read_image(png_bytes(photo, format="PNG", exif=exif.tobytes()))
    np.testing.assert_array_equal(turned, np.rot90(rgb, k=-1))
    # 16-bit grayscale: scaled to 8 bits (Pillow's own conversion would clip everything above 255 to white).
    gray16 = Image.fromarray(np.arange(12, dtype=np.uint16).reshape(3, 4) * 5000)
    np.testing.assert_array_equal(
        read_image(png_bytes(gray16))[..., 0], np.round(np.arange(12).reshape(3, 4) * 5000 / 257)
    )
    # An animated GIF: its first frame.
    frames = [Image.new("RGB", (8, 8), c) for c in ("red", "blue")]
    gif = png_bytes(frames[0], format="GIF", save_all=True, append_images=frames[1:])
    assert read_image(gif)[0, 0].tolist() == [255, 0, 0]
    # Arrays: gray, float in [0, 1], RGBA composited onto white.
    assert read_image(np.full((2, 3), 7, np.uint8)).shape == (2, 3, 3)
    np.testing.assert_array_equal(read_image(np.full((2, 2, 3), 0.5)), np.full((2, 2, 3), 128, np.uint8))
    clear = np.zeros((2, 2, 4), np.uint8)
    np.testing.assert_array_equal(read_image(clear), np.full((2, 2, 3), 255, np.uint8))


# ---- the three APIs, through their official clients ----


@pytest.fixture(scope="module")
def vision_server(gemma):
    from mlxinfer.server import ModelSet, ServerSettings
    from mlxinfer.server.uvicorn_host import BackgroundServer

    models = ModelSet()
    models.add(gemma, name="gemma3_vision")
    with BackgroundServer(models, ServerSettings(port=0)) as running:
        yield running
    models.close()


def data_url(name: str, kind: str = "image/jpeg") -> str:
    return f"data:{kind};base64," + base64.b64encode((IMAGES / name).read_bytes()).decode()


@pytest.mark.slow
def test_openai_ollama_and_anthropic_clients_ask_about_an_image(gemma, vision_server):
    import anthropic
    import ollama
    import openai

    expected = gemma.tokenizer.decode(golden("portrait", "greedy").tolist())
    prompt_tokens = len(golden("portrait", "input_ids"))
    client = openai.OpenAI(base_url=vision_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    parts = [
        {"type": "image_url", "image_url": {"url": data_url("hopper.jpg")}},
        {"type": "text", "text": "Who is this?"},
    ]
    chat = client.chat.completions.create(model="gemma3_vision", messages=[{"role": "user", "content": parts}],
                                          temperature=0, max_tokens=8)  # fmt: skip
    assert (chat.choices[0].message.content, chat.usage.prompt_tokens) == (expected, prompt_tokens)
    # Ollama puts a message's images before its text: the same prompt.
    answer = ollama.Client(host=vision_server.url, timeout=120).chat(
        model="gemma3_vision",
        messages=[{"role": "user", "content": "Who is this?", "images": [IMAGES / "hopper.jpg"]}],
        options={"temperature": 0, "num_predict": 8},
    )
    assert (answer.message.content, answer.prompt_eval_count) == (expected, prompt_tokens)
    source = {"type": "base64", "media_type": "image/jpeg", "data": data_url("hopper.jpg").split(",", 1)[1]}
    message = anthropic.Anthropic(
        base_url=vision_server.url, api_key="x" * 8, max_retries=0, timeout=120
    ).messages.create(
        model="gemma3_vision",
        max_tokens=8,
        extra_body={"temperature": 0},  # anthropic 2.x's create() has no temperature; the API takes it
        messages=[
            {"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": "Who is this?"}]}
        ],
    )
    usage = message.usage  # Anthropic counts the tokens read from the cache apart
    assert (message.content[0].text, usage.input_tokens + usage.cache_read_input_tokens) == (expected, prompt_tokens)


@pytest.mark.slow
def test_bad_images_are_a_400_naming_the_part_and_the_server_keeps_serving(vision_server):
    import httpx

    bomb = with_stated_size(png_bytes(Image.new("RGB", (4, 4))), 100_000, 100_000)
    cases = {
        "https://example.com/cat.png": "messages[0].content[0]: image URLs are not fetched",
        "/etc/passwd": "messages[0].content[0]: an image must be a data: URL",
        "data:image/png;base64," + base64.b64encode(bomb).decode(): "messages[0].content[0]: the image states more",
        "data:image/svg+xml;base64," + base64.b64encode(b"<svg/>").decode(): "SVG images are not supported",
    }
    for url, expected in cases.items():
        parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]
        body = {"model": "gemma3_vision", "messages": [{"role": "user", "content": parts}], "max_tokens": 2}
        response = httpx.post(vision_server.url + "/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 400 and expected in response.json()["error"]["message"], response.text
    many = [{"type": "image_url", "image_url": {"url": data_url("hopper_small.png", "image/png")}}] * 17
    body = {"model": "gemma3_vision", "messages": [{"role": "user", "content": many}], "max_tokens": 2}
    response = httpx.post(vision_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400 and "17 images in one request; at most 16" in response.text
    body = {"model": "gemma3_vision", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert httpx.post(vision_server.url + "/v1/chat/completions", json=body, timeout=60).status_code == 200


def test_an_mlx_vlm_layout_with_a_quantized_tower_loads(tmp_path):
    # mlx-vlm's conversions (mlx-community's Gemma 3 folders) store the tower under vision_tower.vision_model.,
    # its convolution channels last, and its linear layers quantized; the reference is the same folder with those
    # layers dequantized by MLX itself.
    import json
    import shutil

    import mlx.nn as nn
    from mlx.utils import tree_flatten

    vision = mlxinfer.load(MODEL).vision
    nn.quantize(vision.vision_tower, group_size=32, bits=8, class_predicate=lambda p, m: isinstance(m, nn.Linear))
    tower = dict(tree_flatten(vision.vision_tower.parameters()))
    dequantized = {}
    for name, value in tower.items():
        if name.endswith(".scales"):
            path = name.removesuffix(".scales")
            w = mx.dequantize(tower[f"{path}.weight"], value, tower[f"{path}.biases"], group_size=32, bits=8)
            dequantized[f"{path}.weight"] = w
        elif not name.endswith(".biases") or name.removesuffix(".biases") + ".scales" not in tower:
            dequantized.setdefault(name, value)
    text = {k: v for k, v in mx.load(str(MODEL / "model.safetensors")).items() if "vision_tower" not in k}
    folders = {}
    for kind, weights in (("quantized", tower), ("float", dequantized)):
        folder = folders[kind] = tmp_path / kind
        shutil.copytree(MODEL, folder, ignore=shutil.ignore_patterns("model.safetensors", "golden*"))
        named = {f"vision_tower.vision_model.{k}": v for k, v in weights.items()}
        mx.save_safetensors(str(folder / "model.safetensors"), {**text, **named})
    config = json.loads((MODEL / "config.json").read_text())
    (folders["quantized"] / "config.json").write_text(
        json.dumps({**config, "quantization": {"group_size": 32, "bits": 8}})
    )
    answers = []
    for kind in ("quantized", "float"):
        model = mlxinfer.load(folders[kind], prefix_cache_bytes=0)
        held = type(model.vision.vision_tower.encoder.layers[0].mlp.fc1).__name__
        assert held == {"quantized": "QuantizedLinear", "float": "Linear"}[kind]
        answers.append(model.chat(messages("portrait"), max_tokens=8).token_ids)
        _, images = encode_chat(model.tokenizer, model.vision, messages("portrait"), 256)
        features = model.vision(mx.array(images.frames[0]))
        answers.append(np.array(features))
    assert answers[0] == answers[2]
    np.testing.assert_allclose(answers[1], answers[3], atol=1e-4)


# ---- conversion keeps the image half ----


def stored_names(folder: Path) -> set[str]:
    return {n for f in folder.glob("*.safetensors") for n in mx.load(str(f))}


@pytest.mark.slow
def test_a_converted_vision_model_keeps_its_image_half_in_mlx_vlm_layout(tmp_path):
    import json

    from mlxinfer.convert import convert

    out = tmp_path / "float"
    convert(MODEL, out, bits=16, dtype="float32", evaluate=False, progress=False)
    names = stored_names(out)
    assert {n.split(".")[0] for n in names} == {"language_model", "vision_tower", "multi_modal_projector"}
    assert "vision_tower.vision_model.embeddings.patch_embedding.weight" in names  # mlx-vlm's Gemma 3 names
    assert (out / "preprocessor_config.json").read_bytes() == (MODEL / "preprocessor_config.json").read_bytes()
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gemma3" and config["text_config"]["model_type"] == "gemma3_text"
    assert (
        config["architectures"] == ["Gemma3ForConditionalGeneration"] and "architectures" not in config["text_config"]
    )
    assert "kept in float32" in json.loads((out / "mlxinfer-manifest.json").read_text())["image_half"]
    assert (
        mlxinfer.load(out).chat(messages("portrait"), max_tokens=8).token_ids == golden("portrait", "greedy").tolist()
    )


@pytest.mark.slow
def test_a_quantized_vision_conversion_runs_its_text_in_mlx_lm_and_its_images_here(tmp_path):
    from mlxinfer.convert import convert

    from tests.conftest import golden as text_golden
    from tests.test_mlx_lm_roundtrip import mlx_lm_greedy

    out = tmp_path / "8bit"
    convert(MODEL, out, bits=8, dtype="float32", evaluate=False, progress=False)
    ids = text_golden("gemma3_vl")["input_ids"].tolist()  # the same weights' text-only golden prompt
    ours = mlxinfer.load(out)
    assert mlx_lm_greedy(out, ids, 8) == ours.generate(ids, max_tokens=8).token_ids
    assert type(ours._loaded.model.model.layers[0].mlp.up_proj).__name__ == "QuantizedLinear"
    assert type(ours.vision.vision_tower.encoder.layers[0].mlp.fc1).__name__ == "Linear"  # the tower in float
    asked = ours.chat(messages("portrait"), max_tokens=8)
    assert asked.stats.prompt_tokens == len(golden("portrait", "input_ids")) and asked.token_ids
    # The image half came through whole: the same embeddings as the source's for the same picture.
    frames = mx.array(processor_from_folder(out).frames(read_image(IMAGES / "hopper.jpg")))
    np.testing.assert_array_equal(np.array(ours.vision(frames)), np.array(mlxinfer.load(MODEL).vision(frames)))


@pytest.mark.slow
# Qwen3.5's tiny Gated DeltaNet model moves its logits by up to 2.9 at 8 bits (its text-only fixture by 0.9), past
# its greedy margins: it converts unquantized, so its answer about the image is transformers' exactly.
@pytest.mark.parametrize(("name", "bits"), [("mistral3", 8), ("gemma4_vision", 8), ("qwen3_5_vision", 16),
                                            ("qwen3_vl_vision", 8)])  # fmt: skip
def test_a_converted_vision_model_keeps_its_float_tower_and_mlx_lm_runs_its_text(tmp_path, name, bits):
    from mlx.utils import tree_flatten
    from mlxinfer.convert import convert

    from tests.test_mlx_lm_roundtrip import mlx_lm_greedy

    source, out = TINY / name, tmp_path / "converted"
    convert(source, out, bits=bits, dtype="float32", evaluate=False, progress=False)
    ours = mlxinfer.load(out)
    ids = ours.tokenizer.encode("Who wrote the first compiler? She")
    assert mlx_lm_greedy(out, ids, 8) == ours.generate(ids, max_tokens=8).token_ids
    assert ours.chat(messages("portrait"), max_tokens=8).token_ids == golden("portrait", "greedy", name).tolist()
    with safe_open(str(out / "model-00001-of-00001.safetensors"), "numpy") as stored:
        names = set(stored.keys())
    tower = [n for n, _ in tree_flatten(ours.vision.parameters())]
    assert tower and all(ours.vision.exported(n) in names for n in tower)  # mlx-vlm's names, every one in float:
    assert not any(n.endswith(".scales") for n in tower)
    frames = mx.array(ours.vision.processor.frames(read_image(IMAGES / "hopper_wide.png")))
    np.testing.assert_array_equal(np.array(ours.vision(frames)), np.array(mlxinfer.load(source).vision(frames)))


# ---- images by address (mlxinfer serve --image-urls) and by path (the user's own front ends) ----


REDIRECTS = {"/loop": "/loop", "/to-file": "file:///etc/passwd", "/to-ftp": "ftp://127.0.0.1/hopper.jpg"}


@pytest.fixture(scope="module")
def image_site():
    """A local web server: /hopper.jpg, a redirect loop, redirects to file: and ftp: and a body past every limit."""
    import http.server
    import threading

    photo = (IMAGES / "hopper.jpg").read_bytes()

    class Site(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            served.append(self.path)
            if self.path == "/hopper.jpg":
                self.send_response(200)
                self.send_header("Content-Length", str(len(photo)))
                self.end_headers()
                self.wfile.write(photo)
            elif self.path in REDIRECTS:
                self.send_response(302)
                self.send_header("Location", REDIRECTS[self.path])
                self.end_headers()
            elif self.path == "/endless":  # no Content-Length: read until the limit cuts it off
                self.send_response(200)
                self.end_headers()
                try:
                    for _ in range(64):
                        self.wfile.write(b"\0" * 65536)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the fetcher hung up at its limit, as it should
            else:
                self.send_error(404)

        def log_message(self, *args):
            pass

    served: list[str] = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Site)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield SiteURL(f"http://127.0.0.1:{server.server_address[1]}", served)
    server.shutdown()


class SiteURL(str):
    """The site's address; `.served` lists the paths it was asked for."""

    def __new__(cls, url: str, served: list[str]):
        made = super().__new__(cls, url)
        made.served = served
        return made


def test_fetching_an_image_is_bounded(image_site):
    from mlxinfer.vision.fetch import fetch_image

    assert fetch_image(image_site + "/hopper.jpg", "image", 1 << 20) == (IMAGES / "hopper.jpg").read_bytes()
    for path, words in {
        "/loop": "HTTP 302",
        "/to-file": "is not allowed",  # urllib's own refusal
        "/to-ftp": "redirected away from http",  # ours: urllib would follow it
        "/endless": "more than 1 MiB",
        "/missing": "HTTP 404",
    }.items():
        with pytest.raises(ImageError, match=words):
            fetch_image(image_site + path, "messages[0].content[0]", 1 << 20)
    with pytest.raises(ImageError, match="only http and https"):
        fetch_image("file:///etc/passwd", "image", 1 << 20)


def test_a_request_with_too_many_or_too_large_addresses_is_refused_before_or_while_fetching(gemma, image_site):
    from mlxinfer.engine import RequestSources

    def asking(*urls: str) -> list[dict]:
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in urls]}]

    before = len(image_site.served)
    with pytest.raises(ImageError, match="17 images in one request"):
        encode_chat(gemma.tokenizer, gemma.vision, asking(*[image_site + "/hopper.jpg"] * 17), 256,
                    remote=RequestSources(urls=True))  # fmt: skip
    assert len(image_site.served) == before  # nothing fetched
    photo = (IMAGES / "hopper.jpg").stat().st_size
    with pytest.raises(ImageError, match=r"messages\[0\]\.content\[1\]: the image at that address is more than"):
        encode_chat(gemma.tokenizer, gemma.vision, asking(*[image_site + "/hopper.jpg"] * 2), 256,
                    Limits(max_fetched_bytes=photo + photo // 2), remote=RequestSources(urls=True))  # fmt: skip


def test_configs_cannot_make_an_image_expand_without_bound():
    from mlxinfer.errors import ConfigError
    from mlxinfer.models.vision import ImageFormat
    from mlxinfer.vision.preprocess import _split_processor

    raw = {"size": {"longest_edge": 9 * 32}, "max_image_size": {"longest_edge": 32}}
    with pytest.raises(ConfigError, match="more than 8 tiles a side"):
        _split_processor(raw, "preprocessor_config.json")
    assert _split_processor({**raw, "size": {"longest_edge": 8 * 32}}, "p").layout(10_000, 10_000) == Layout(8, 8)
    with pytest.raises(ConfigError, match="an image frame of 16385 tokens"):
        ImageFormat("<image>", 1, 16_385, False, lambda layout: "")


def test_gemma3_pan_and_scan_configs_are_bounded_and_checked():
    from mlxinfer.errors import ConfigError
    from mlxinfer.vision.pan_and_scan import PanAndScan

    on = {"do_pan_and_scan": True}
    assert PanAndScan.from_config({"do_pan_and_scan": None}, "p") is None
    assert PanAndScan.from_config(on, "p") == PanAndScan(256, 4, 1.2)  # Gemma3Processor's defaults for nulls
    bad = [({"do_pan_and_scan": "yes"}, "do_pan_and_scan must be true, false or null"),
           ({**on, "pan_and_scan_max_num_crops": 9}, r"pan_and_scan_max_num_crops must be an integer in \[2, 8\]"),
           ({**on, "pan_and_scan_min_crop_size": 0}, "pan_and_scan_min_crop_size must be an integer"),
           ({**on, "pan_and_scan_min_ratio_to_activate": float("nan")}, "pan_and_scan_min_ratio")]  # fmt: skip
    for raw, message in bad:
        with pytest.raises(ConfigError, match=message):
            PanAndScan.from_config(raw, "preprocessor_config.json")
    # however long the image, at most 8 crops and the whole: 9 frames
    assert PanAndScan(1, 8, 1.0).grid(4096, 1) == (1, 8)


def test_mistral3_configs_cannot_make_an_image_expand_without_bound():
    # Mistral 3 sizes a frame by the image: its config's largest image bounds the tokens, and the processor may not
    # resize past it. The tiny fixture: 4-pixel patches merged 2 x 2, image_size 64: at most 8 x 8 tokens.
    import json

    from mlxinfer.errors import ConfigError
    from mlxinfer.families.llama import mistral3_vision
    from mlxinfer.vision.preprocess import PatchProcessor

    raw = json.loads((TINY / "mistral3" / "config.json").read_text())
    model = mlxinfer.load(TINY / "mistral3").vision
    assert model.processor.layout(10_000, 50).grid == (1, 8) and model.format.tokens_per_frame == 64
    with pytest.raises(ConfigError, match="gives images of up to 81 tokens; .* allows 64"):
        model.fitted(PatchProcessor(72, 4))
    too_large = {**raw, "vision_config": {**raw["vision_config"], "image_size": 4096, "patch_size": 4}}
    with pytest.raises(ConfigError, match="an image frame of 262144 tokens"):
        mistral3_vision(too_large, {}, mx.float32, "config.json")


def test_gemma4_configs_bound_an_images_patches_before_any_is_read():
    from dataclasses import replace

    from mlxinfer.errors import ConfigError
    from mlxinfer.vision.preprocess import _budget_processor

    vision = mlxinfer.load(TINY / "gemma4_vision").vision  # 70 tokens of 2 x 2 patches: 140 patches a side at most
    assert vision.processor.layout(10_000, 10).grid == (1, 70)  # the longest strip the budget allows
    with pytest.raises(ConfigError, match="position_embedding_size 160 is shorter than the 280 patches"):
        vision.fitted(replace(vision.processor, max_soft_tokens=140, pooling=2))
    for budget in (100, True, "280"):
        with pytest.raises(ConfigError, match="max_soft_tokens must be one of"):
            _budget_processor({"max_soft_tokens": budget}, "preprocessor_config.json")
    with pytest.raises(ConfigError, match="would pass 4096² pixels"):
        _budget_processor({"max_soft_tokens": 1120, "patch_size": 64, "pooling_kernel_size": 3}, "p")


def test_qwen_configs_bound_an_images_tokens_before_any_is_read(qwen):
    from dataclasses import replace

    from mlxinfer.errors import ConfigError
    from mlxinfer.vision.preprocess import _pixel_range_processor

    processor = qwen.vision.processor  # at most 4096 pixels of 8-pixel tokens: 64 tokens
    assert processor.layout(10_000, 10_000).grid == (8, 8) and qwen.vision.format.tokens_per_frame == 64
    with pytest.raises(ImageError, match="over 200 times longer than wide"):
        processor.layout(10, 2001)
    # 200:1 passes transformers' check, but its short side stays one token as the long one shrinks: 113 tokens.
    with pytest.raises(ImageError, match="would take 113 tokens, more than 64"):
        processor.layout(1600, 8)
    with pytest.raises(ConfigError, match=r"size.longest_edge \(pixels\) must be an integer in \[1, 16777216\]"):
        _pixel_range_processor({"size": {"shortest_edge": 1, "longest_edge": 4097**2}}, "preprocessor_config.json")
    with pytest.raises(ConfigError, match="shortest_edge 512 is above size.longest_edge 256"):
        _pixel_range_processor({"min_pixels": 512, "max_pixels": 256}, "preprocessor_config.json")
    with pytest.raises(ConfigError, match="patch_size 8 and merge_size 2 must be config.json's"):
        qwen.vision.fitted(replace(processor, patch=8))
    # 16.7 megapixels (Qwen3-VL's) of this tower's 8-pixel tokens: 262,144 tokens an image, past what a frame may take.
    with pytest.raises(ConfigError, match="an image frame of 262144 tokens"):
        qwen.vision.fitted(replace(processor, max_pixels=4096**2))
    assert qwen.vision.format.tokens_per_frame == 64


def test_lfm2_vl_configs_bound_an_images_frames_before_any_is_read():
    from dataclasses import replace

    from mlxinfer.errors import ConfigError, UnsupportedModelError
    from mlxinfer.vision.preprocess import _tile_processor

    vision = mlxinfer.load(TINY / "lfm2_vl").vision  # 32-pixel tiles (16 tokens), 2 to 4 of them; frames of 4-16 tokens
    assert vision.processor.layout(10_000, 10_000) == Layout(2, 2, (4, 4)) and vision.format.tokens_per_frame == 16
    with pytest.raises(ImageError, match="would take 126 tokens, more than 16"):  # 4 tiles and a 1 x 126 thumbnail
        vision.processor.layout(10_000, 10)
    with pytest.raises(ConfigError, match=r"max_image_tokens must be an integer in \[1, 16384\]"):
        _tile_processor({"max_image_tokens": 16_385}, "preprocessor_config.json")
    with pytest.raises(ConfigError, match="max_tiles must be an integer in"):
        _tile_processor({"max_tiles": 65}, "preprocessor_config.json")
    with pytest.raises(ConfigError, match="must not pass their max_"):
        _tile_processor({"min_image_tokens": 300}, "preprocessor_config.json")
    with pytest.raises(UnsupportedModelError, match="without a thumbnail"):
        _tile_processor({"use_thumbnail": False}, "preprocessor_config.json")
    for huge in ({"tile_size": 4096, "max_tiles": 2}, {"encoder_patch_size": 1024, "max_image_tokens": 64}):
        with pytest.raises(ConfigError, match="would pass 4096² pixels"):
            _tile_processor(huge, "preprocessor_config.json")
    with pytest.raises(ConfigError, match="encoder_patch_size 8 and downsample_factor 2 must be config.json's"):
        vision.fitted(replace(vision.processor, patch=8))
    import json

    from mlxinfer.families.lfm2 import vision as lfm2_vision

    raw = json.loads((TINY / "lfm2_vl" / "config.json").read_text())
    tower = raw["vision_config"]
    for change, words in (({"vision_config": "x"}, "vision_config must be an object"),
                          ({"vision_config": {**tower, "num_patches": 15}}, "must be a square up to 256²"),
                          ({"vision_config": {**tower, "patch_size": "16"}}, "patch_size must be an integer"),
                          ({"downsample_factor": 0}, r"downsample_factor must be an integer in \[1, 8\]")):  # fmt: skip
        with pytest.raises(ConfigError, match=words):
            lfm2_vision({**raw, **change}, {}, mx.float32, "config.json")


def test_a_large_pixtral_image_attends_in_blocks_of_queries_as_at_once(monkeypatch):
    # A 1540-pixel image is 12,100 patches: their scores are computed a block of queries at a time.
    from mlxinfer.models import vision_attention

    vision = mlxinfer.load(TINY / "mistral3").vision
    pixels = mx.array(vision.processor.frames(read_image(IMAGES / "hopper.jpg")))  # 16 x 14 patches
    whole = vision(pixels)
    monkeypatch.setattr(vision_attention, "QUERY_BLOCK", 7)
    np.testing.assert_allclose(np.array(vision(pixels)), np.array(whole), atol=1e-5)


@pytest.mark.slow
def test_a_server_fetches_image_urls_only_when_started_so_and_reads_paths_only_for_its_token(gemma, image_site):
    import httpx

    from mlxinfer.server import ModelSet, ServerSettings
    from mlxinfer.server.uvicorn_host import BackgroundServer

    def ask(url: str, source: str, headers: dict | None = None) -> httpx.Response:
        parts = [{"type": "image_url", "image_url": {"url": source}}, {"type": "text", "text": "Who is this?"}]
        body = {"model": "gemma3_vision", "messages": [{"role": "user", "content": parts}], "max_tokens": 8,
                "temperature": 0}  # fmt: skip
        return httpx.post(url + "/v1/chat/completions", json=body, headers=headers or {}, timeout=60)

    expected = gemma.tokenizer.decode(golden("portrait", "greedy").tolist())
    for image_urls in (False, True):
        models = ModelSet()
        models.add(gemma, name="gemma3_vision")
        settings = ServerSettings(port=0, image_urls=image_urls, local_token="t" * 32)
        with BackgroundServer(models, settings) as running:
            fetched = ask(running.url, image_site + "/hopper.jpg")
            by_path = ask(running.url, str(IMAGES / "hopper.jpg"), {"Authorization": "Bearer " + "t" * 32})
            stranger = ask(running.url, str(IMAGES / "hopper.jpg"))
        models.close()
        if image_urls:
            assert fetched.json()["choices"][0]["message"]["content"] == expected
        else:
            assert fetched.status_code == 400 and "start the server with --image-urls" in fetched.text
        assert by_path.json()["choices"][0]["message"]["content"] == expected
        assert stranger.status_code == 400 and "must be a data: URL" in stranger.text
