"""Content hashing: identity of pixels, sensitivity to every pixel and parameter, namespaces."""

import numpy as np
import pytest
import torch
from PIL import Image

import samcache
from samcache import ContentHash, Namespace, hash_image


def screenshot(seed=0, h=72, w=128):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def test_same_pixels_same_hash_whatever_the_container(tmp_path):
    arr = screenshot()
    h = hash_image(arr)
    assert h == hash_image(arr.copy()) == hash_image(Image.fromarray(arr)) == hash_image(torch.from_numpy(arr).numpy())
    Image.fromarray(arr).save(tmp_path / "a.png")
    Image.fromarray(arr).save(tmp_path / "b.png", compress_level=9)  # other bytes, same pixels
    assert hash_image(tmp_path / "a.png") == hash_image(str(tmp_path / "b.png")) == h
    assert isinstance(h, ContentHash) and len(h.digest) == 16 and len(h.hex()) == 32


def test_one_pixel_changes_the_hash():
    arr = screenshot()
    base = hash_image(arr)
    rng = np.random.default_rng(1)
    for _ in range(20):
        y, x, c = rng.integers(72), rng.integers(128), rng.integers(3)
        changed = arr.copy()
        changed[y, x, c] ^= 1
        assert hash_image(changed) != base


def test_shape_dtype_mode_and_preprocessing_are_part_of_the_hash():
    arr = screenshot()
    base = hash_image(arr)
    assert hash_image(arr.reshape(128, 72, 3)) != base
    assert hash_image(arr.astype(np.uint16)) != base
    assert hash_image(Image.fromarray(arr).convert("YCbCr")) != hash_image(np.asarray(Image.fromarray(arr).convert("YCbCr")))
    p = {"min_pixels": 3136, "max_pixels": 1003520, "mean": [0.48, 0.45, 0.40]}
    assert hash_image(arr, preprocess=p) != base
    assert hash_image(arr, preprocess=p) == hash_image(arr, preprocess=dict(reversed(list(p.items()))))
    assert hash_image(arr, preprocess={**p, "max_pixels": 1003521}) != hash_image(arr, preprocess=p)
    assert hash_image(arr.astype(">u2")) == hash_image(arr.astype("<u2"))  # values, not byte order


def test_exif_orientation_is_applied_for_paths(tmp_path):
    arr = screenshot(h=4, w=6)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees on display
    Image.fromarray(arr).save(tmp_path / "rotated.png", exif=exif)
    Image.fromarray(arr).save(tmp_path / "plain.png")
    assert hash_image(tmp_path / "rotated.png") != hash_image(tmp_path / "plain.png")
    assert hash_image(tmp_path / "plain.png") == hash_image(arr)


def test_bool_images_hash_their_values():
    bits = np.random.default_rng(0).integers(0, 2, (8, 8)).astype(bool)
    img = Image.fromarray(bits)  # mode "1"
    assert hash_image(img) == hash_image(bits) == hash_image(np.asarray(img))
    assert hash_image(bits) != hash_image(bits.astype(np.uint8))


def test_palette_images_hash_their_colours():
    idx = np.zeros((4, 4), dtype=np.uint8)
    a = Image.fromarray(idx, mode="P")
    b = Image.fromarray(idx, mode="P")
    a.putpalette([255, 0, 0] * 256)
    b.putpalette([0, 0, 255] * 256)
    assert hash_image(a) != hash_image(b)


def test_tensors_hash_dtype_and_shape():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert hash_image(t) == hash_image(t.clone())
    assert hash_image(t) != hash_image(t.to(torch.bfloat16))
    assert hash_image(t) != hash_image(t.reshape(4, 3))
    assert hash_image(t.t()) == hash_image(t.t().contiguous())


def test_bad_images(tmp_path):
    (tmp_path / "broken.png").write_bytes(b"not an image")
    with pytest.raises(ValueError, match="cannot read image"):
        hash_image(tmp_path / "broken.png")
    with pytest.raises(ValueError, match="cannot read image"):
        hash_image(tmp_path / "missing.png")
    with pytest.raises(TypeError):
        hash_image(12)
    with pytest.raises(TypeError):
        hash_image(np.array(["a", "b"]))
    with pytest.raises(TypeError, match="JSON"):
        hash_image(screenshot(), preprocess={"fn": object()})
    with pytest.raises(TypeError):
        hash_image(screenshot(), preprocess=[1, 2])
    with pytest.raises(TypeError):
        samcache.hash_bytes("text")


def test_namespace_keys():
    c = samcache.hash_bytes(b"page")
    keys = {
        Namespace("m").key(c),
        Namespace("m", tenant="").key(c),
        Namespace("m", tenant=b"").key(c),
        Namespace("m", tenant="t").key(c),
        Namespace("m2").key(c),
        Namespace("m").key(samcache.hash_bytes(b"page2")),
    }
    assert len(keys) == 6
    assert Namespace("m", tenant="t").key(c) == Namespace("m", tenant="t").key(c)
    with pytest.raises(ValueError):
        Namespace("")
    with pytest.raises(TypeError):
        Namespace("m", tenant=3)
    with pytest.raises(TypeError):
        Namespace("m").key(b"x" * 16)


def test_at_ordinal_gives_each_index_its_own_hash():
    from samcache.hashing import at_ordinal

    c = samcache.hash_bytes(b"screenshot")
    hashes = {at_ordinal(c, i) for i in range(4)} | {c, at_ordinal(samcache.hash_bytes(b"other"), 0)}
    assert len(hashes) == 6
    assert at_ordinal(c, 2) == at_ordinal(c, 2)
    with pytest.raises(ValueError, match="index"):
        at_ordinal(c, -1)
    with pytest.raises(ValueError, match="index"):
        at_ordinal(c, True)
    with pytest.raises(TypeError, match="ContentHash"):
        at_ordinal(b"x" * 16, 0)
