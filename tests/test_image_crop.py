"""data.image_crop and data.delete_text: AReaL's Geometry3K preprocessing
(areal/dataset/geometry3k.py at 524d1d90f: convert_image(image, 448, 448) = torchvision CenterCrop,
then JPEG; `.replace("different", "")` on every problem)."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

import config as C
import data
import synthetic


def torchvision_center_crop(a: np.ndarray, side: int) -> np.ndarray:
    """torchvision.transforms.functional.center_crop on an [H, W, 3] array, from its source
    (torchvision/transforms/functional.py center_crop): pad with 0 by [(side - w) // 2,
    (side - h) // 2, (side - w + 1) // 2, (side - h + 1) // 2] where smaller, then crop at
    int(round((h - side) / 2.0)), int(round((w - side) / 2.0))."""
    h, w = a.shape[:2]
    if side > w or side > h:
        pl, pt = ((side - w) // 2 if side > w else 0), ((side - h) // 2 if side > h else 0)
        pr, pb = ((side - w + 1) // 2 if side > w else 0), ((side - h + 1) // 2 if side > h else 0)
        a = np.pad(a, ((pt, pb), (pl, pr), (0, 0)))
        h, w = a.shape[:2]
        if (h, w) == (side, side):
            return a
    top, left = int(round((h - side) / 2.0)), int(round((w - side) / 2.0))
    return a[top:top + side, left:left + side]


def noise(w: int, h: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(1, 256, (h, w, 3), dtype=np.uint8))


@pytest.mark.parametrize("size", [(600, 300), (300, 600), (449, 1000), (447, 447), (448, 448), (601, 603)])
def test_center_crop_is_torchvision_centercrop(size):
    im = noise(*size)
    got = np.asarray(data.center_crop(im, 448))
    assert got.shape == (448, 448, 3)
    assert np.array_equal(got, torchvision_center_crop(np.asarray(im), 448))
    if size == (600, 300):   # padded top and bottom with black, cut left and right
        assert (got[:74] == 0).all() and (got[-74:] == 0).all() and (got[74:-74] > 0).all()


def test_crop_image_is_the_crop_jpeg_reencoded():
    im = noise(300, 600, seed=1)
    out = data.crop_image(im, 448)
    assert out.size == (448, 448) and out.mode == "RGB"
    import io
    buf = io.BytesIO()
    data.center_crop(im, 448).save(buf, format="JPEG")   # PIL's default quality, as AReaL
    assert np.array_equal(np.asarray(out), np.asarray(Image.open(buf).convert("RGB")))
    assert not np.array_equal(np.asarray(out), np.asarray(data.center_crop(im, 448)))  # lossy


def test_448_crop_is_256_image_tokens_for_qwen2_5_vl(tiny_dir):
    """With the processor's default pixel bounds (Qwen2.5-VL's preprocessor: 56 x 56 to
    28 x 28 x 16384), 448 x 448 -> a 32 x 32 patch grid -> 256 tokens after the 2 x 2 merge."""
    import inputs as I
    procs = I.load_processors(tiny_dir("qwen2_5_vl"), 56 * 56, 28 * 28 * 16384)
    for size in [(600, 300), (300, 600), (1200, 900)]:
        cropped = data.crop_image(noise(*size), 448)
        assert I.image_tokens(procs, [cropped]) == 256
    assert I.image_tokens(procs, [noise(600, 300)]) != 256   # uncropped: the size decides


def test_recipe_deletes_text_and_crops_on_load():
    dc = C.DataConfig(source="synthetic", n_synthetic=8, image_size=112, image_crop=64,
                      delete_text=["different", "the"])
    plain = data.load_sources(C.DataConfig(source="synthetic", n_synthetic=8, image_size=112), "train",
                              seed=0, prompt_len=lambda p: 1)[0]
    got = data.load_sources(dc, "train", seed=0, prompt_len=lambda p: 1)[0]
    assert len(got) == len(plain) == 8
    for a, b in zip(plain, got):
        assert b.problem == a.problem.replace("different", "").replace("the", "")
        assert all(im.size == (64, 64) for im in b.images) and a.images[0].size == (112, 112)
    assert any("the" in a.problem for a in plain)
    p = synthetic.Problem(0, [], "Find the different angle of two different lines.", "3",
                          raw="Find <image> the different angle")
    q = data.prepare_problem(p, C.DataConfig(delete_text=["different"]))
    assert (q.problem, q.raw) == ("Find the  angle of two  lines.", "Find <image> the  angle")  # AReaL's str.replace


def test_keys_at_load():
    from errors import ConfigError
    from train import load_config
    with pytest.raises(ConfigError, match="data.image_crop must be >= 0"):
        load_config(None, ["--data.image_crop=-1"])
    with pytest.raises(ConfigError, match="data.delete_text: expected a list of non-empty strings"):
        load_config(None, ['--data.delete_text=[""]'])
