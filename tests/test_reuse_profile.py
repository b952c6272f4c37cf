"""The reuse profile (samcache.profile.reuse_profile): written atomically by `samcache calibrate`,
read by the engine by itself, refused for another checkpoint; and the default it replaces: with no
profile and no calibration, image order is kept (exact)."""

import json
import shutil

import pytest

pytest.importorskip("transformers")

from samcache.cli import main as cli  # noqa: E402
from samcache.engine import SAMcacheEngine, screenshot  # noqa: E402
from samcache.engine.prompt import user_message  # noqa: E402
from samcache.profile import reuse_profile  # noqa: E402
from samcache.profile.image_attention import ImageAttention, declare  # noqa: E402
from samcache.profile.reuse_profile import PROFILE_FILE, make_profile, read_profile, write_profile  # noqa: E402

from engine_helpers import SIZE, assert_clean  # noqa: E402


@pytest.fixture()
def causal(tiny_checkpoints, tmp_path):
    out = tmp_path / "causal"
    shutil.copytree(tiny_checkpoints["qwen2_5_vl"], out)
    return out


@pytest.fixture()
def isolated(tiny_checkpoints, tmp_path):
    out = tmp_path / "isolated"
    shutil.copytree(tiny_checkpoints["qwen2_5_vl"], out)
    declare(out, ImageAttention("isolated"))
    return out


def swapped_hits(engine) -> int:
    a, b = screenshot(41, SIZE), screenshot(42, SIZE)
    engine.chat(messages=[{"role": "system", "content": "One."}, user_message([a, b], "Look.")], max_new_tokens=1)
    r = engine.chat(messages=[{"role": "system", "content": "Another one."}, user_message([b, a], "Now?")],
                    max_new_tokens=1)
    assert_clean(engine)
    return r.metrics.image_kv_hits


def test_without_profile_or_calibration_the_order_is_kept(causal):
    engine = SAMcacheEngine(causal, device="cpu", kv_cache_bytes=16 << 20)
    assert engine.profile is None and engine.keeps_image_order()
    assert swapped_hits(engine) == 0  # moved images are prefilled again, never reused approximately
    assert swapped_hits(SAMcacheEngine(causal, device="cpu", kv_cache_bytes=16 << 20, keep_image_order=False)) == 2


def test_an_isolated_model_reuses_at_any_index_without_a_profile(isolated):
    engine = SAMcacheEngine(isolated, device="cpu", kv_cache_bytes=16 << 20)
    assert engine.profile is None and not engine.keeps_image_order()
    assert swapped_hits(engine) == 2


def test_calibrate_writes_the_profile_and_engines_read_it(causal):
    engine = SAMcacheEngine(causal, device="cpu", kv_cache_bytes=16 << 20)
    curves = engine.calibrate(rates=(0.0, 0.5, 1.0), continuation=4, progress=False)
    path = engine.save_profile()
    assert path == causal / PROFILE_FILE and not list(causal.glob(".samcache_profile.*"))
    data = json.loads(path.read_text())
    assert data["image_attention"]["mode"] == "causal" and set(data["keep_order"]) == {"0.0", "0.5", "1.0"}
    again = SAMcacheEngine(causal, device="cpu", kv_cache_bytes=16 << 20)
    assert again.profile is not None and again.sensitivity.rates.tolist() == curves.rates.tolist()
    assert again.profile.fingerprint in engine.model_id
    # random weights are never confident: the check finds no evidence against any-index reuse
    assert [again.keeps_image_order(r) for r in (0.0, 0.5)] == [again.profile.keep_order[r] for r in (0.0, 0.5)]
    assert SAMcacheEngine(causal, device="cpu", kv_cache_bytes=4 << 20, profile=False).profile is None


def test_calibrate_command(isolated, causal, capsys):
    assert cli(["calibrate", str(isolated), "--quiet"]) == 0
    profile = read_profile(isolated, isolated)
    assert profile.image_attention.isolated and profile.curves is None
    assert "reused at any index, exactly" in capsys.readouterr().out
    assert cli(["calibrate", str(causal / "nothing-here")]) == 2
    assert "samcache calibrate:" in capsys.readouterr().err


def test_bad_profiles_are_refused_naming_the_file(causal, isolated, tmp_path):
    profile = make_profile(isolated, None)
    path = write_profile(profile, isolated)
    other = tmp_path / "other"
    shutil.copytree(causal, other)
    shutil.copy(path, other / PROFILE_FILE)
    with pytest.raises(ValueError, match=rf"{PROFILE_FILE} was made for checkpoint {profile.fingerprint}, but .*other is"):
        SAMcacheEngine(other, device="cpu", kv_cache_bytes=4 << 20)
    data = profile.to_dict()
    data["image_attention"] = {"mode": "sideways"}
    (isolated / PROFILE_FILE).write_text(json.dumps(data))
    with pytest.raises(ValueError, match=rf"{PROFILE_FILE} \[image_attention\].*unknown image attention 'sideways'"):
        SAMcacheEngine(isolated, device="cpu", kv_cache_bytes=4 << 20)
    (isolated / PROFILE_FILE).write_text('{"format": "samcache-reuse-profile/1", "fingerp')
    with pytest.raises(ValueError, match="is not JSON"):
        read_profile(isolated)
    (isolated / PROFILE_FILE).write_text(json.dumps({"curves": None}))
    with pytest.raises(ValueError, match="is not a samcache reuse profile"):
        read_profile(isolated)
    # a profile that disagrees with the checkpoint's declared attention
    causal_profile = make_profile(isolated, None, ImageAttention())
    write_profile(causal_profile, isolated)
    with pytest.raises(ValueError, match="says image attention causal, but .*declares isolated"):
        read_profile(isolated, isolated)


def test_curves_of_another_depth_are_refused(causal, tmp_path):
    engine = SAMcacheEngine(causal, device="cpu", kv_cache_bytes=16 << 20)
    engine.calibrate(rates=(0.0, 1.0), continuation=2, check=False, progress=False)
    path = engine.save_profile(tmp_path / "p.json")
    data = json.loads(path.read_text())
    data["curves"]["loss"] = data["curves"]["loss"][:-1]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"p\.json: its curves have \d+ layers, the model has \d+"):
        SAMcacheEngine(causal, device="cpu", kv_cache_bytes=4 << 20, profile=path)


def test_a_half_written_profile_is_never_read(isolated, monkeypatch):
    write_profile(make_profile(isolated, None), isolated)
    before = (isolated / PROFILE_FILE).read_text()

    def broken(obj, f, **kw):
        f.write('{"format": "samcache-reuse-pro')
        raise OSError("disk full")

    monkeypatch.setattr(reuse_profile.json, "dump", broken)
    with pytest.raises(OSError, match="disk full"):
        write_profile(make_profile(isolated, None), isolated)
    assert (isolated / PROFILE_FILE).read_text() == before and not list(isolated.glob(".samcache_profile.*"))


def test_the_plugins_read_the_profile_from_the_model_folder(causal, isolated):
    from samcache.integrations.settings import ReuseSettings

    settings = ReuseSettings()
    assert settings.reuse_profile(str(causal), 4) is None and settings.keeps_image_order(4)  # no profile: order kept
    engine = SAMcacheEngine(causal, device="cpu", kv_cache_bytes=16 << 20)
    engine.calibrate(rates=(0.0, 0.05, 1.0), continuation=2, progress=False)
    engine.save_profile()
    layers = engine.runner.num_layers
    profile = settings.reuse_profile(str(causal), layers)
    assert profile is not None and settings.curves(layers, profile) is profile.curves
    assert settings.keeps_image_order(layers, profile) == engine.keeps_image_order()
    assert ReuseSettings.from_mapping({"profile": str(causal / PROFILE_FILE)}, source="test").reuse_profile(
        None, layers) is not None
    assert settings.isolated_serving(str(causal), profile, frame_token=7) is None
    with pytest.raises(ValueError, match="profile must be the path"):
        ReuseSettings.from_mapping({"profile": 3}, source="test")


def test_the_plugins_serve_a_model_isolated_at_every_layer_and_refuse_the_rest(isolated, tmp_path):
    """What the plugins read from an isolated checkpoint (its folder, or its profile): how to
    compute its first-seen images; the top-k variant and explicit recompute rates are refused."""
    from samcache.integrations.settings import ReuseSettings

    settings = ReuseSettings()
    profile = settings.reuse_profile(str(isolated), 4)  # no profile written: the folder's declaration
    serving = settings.isolated_serving(str(isolated), profile, frame_token=7)
    assert serving.attention == ImageAttention("isolated") and serving.frame_token == 7
    assert serving.prefix(3) == [3, 7] and serving.check(3) == ("image-attention", "isolated", 3)
    assert serving.check(None) != serving.check(3)  # an unknown first token matches no record
    write_profile(make_profile(isolated, None), isolated)
    assert settings.isolated_serving(None, settings.reuse_profile(str(isolated), 4), frame_token=7) == serving
    with pytest.raises(ValueError, match="names no vision_start_token_id"):
        settings.isolated_serving(str(isolated), None, frame_token=None)
    with pytest.raises(ValueError, match="drop recompute_rates"):
        ReuseSettings(recompute_rates=(0.1,) * 4).isolated_serving(str(isolated), None, frame_token=7)
    top = tmp_path / "top"
    shutil.copytree(isolated, top)
    (top / PROFILE_FILE).unlink()
    declare(top, ImageAttention("isolated", context_layers=2))
    with pytest.raises(ValueError, match="keeps its top 2 layers in context, which the plugins do not serve"):
        settings.isolated_serving(str(top), None, frame_token=7)
    nosink = ImageAttention("isolated", sink=False)
    declare(top, nosink)
    serving = settings.isolated_serving(str(top), None, frame_token=7)
    assert serving.prefix(None) == [7] and serving.check(None) == ("image-attention", "isolated-nosink", None)
