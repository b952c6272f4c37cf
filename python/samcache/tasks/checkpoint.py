"""The trained visual-QA checkpoint shipped with samcache: where it is, how it is checked, how a
training run becomes one.

The checkpoint is a tiny Qwen2.5-VL trained on :mod:`samcache.tasks.visual_qa` by
:mod:`samcache.tasks.training` (the script and its ``training.json`` travel with it, so anyone can
reproduce it from the seed). It is stored in float16 safetensors with a SHA-256 of every file in
``SHA256SUMS``; :func:`trained_model` verifies them before handing out the path, so a truncated or
altered file is an error, never a silently different model. Any engine that loads Hugging Face
checkpoints loads the folder (samcache's engine runs it in float32 on CPU by default).

    from samcache.tasks.checkpoint import trained_model
    engine = SAMcacheEngine(trained_model())
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import shutil

#: The folder of the shipped checkpoint, inside the package.
SHIPPED = pathlib.Path(__file__).with_name("checkpoints") / "visual-qa"
#: The same model fine-tuned to isolated image attention (samcache.profile.image_attention).
SHIPPED_ISOLATED = pathlib.Path(__file__).with_name("checkpoints") / "visual-qa-isolated"
CHECKSUMS = "SHA256SUMS"
#: The files a shipped checkpoint holds (all of them checksummed).
FILES = ("config.json", "generation_config.json", "model.safetensors", "processor_config.json", "tokenizer.json",
         "tokenizer_config.json", "chat_template.jinja", "training.json")


class CheckpointError(RuntimeError):
    """The shipped checkpoint is missing, incomplete or does not match its checksums."""


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_checksums(folder) -> dict[str, str]:
    """{file name: SHA-256} from ``folder``/SHA256SUMS (``sha256sum`` format)."""
    path = pathlib.Path(folder) / CHECKSUMS
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: not a shipped checkpoint (see samcache.tasks.checkpoint.ship)")
    sums = {}
    for line in path.read_text().splitlines():
        if line.strip():
            digest, _, name = line.partition("  ")
            sums[name.strip()] = digest.strip()
    return sums


def verify(folder) -> pathlib.Path:
    """Check every file of the checkpoint in ``folder`` against its SHA256SUMS; the folder's path."""
    folder = pathlib.Path(folder)
    sums = read_checksums(folder)
    missing = [n for n in FILES if n not in sums]
    if missing:
        raise CheckpointError(f"{folder / CHECKSUMS} lists no checksum for {', '.join(missing)}")
    for name, digest in sums.items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing from the checkpoint")
        if _sha256(path) != digest:
            raise CheckpointError(f"{path} does not match its checksum in {CHECKSUMS}: the file is damaged or "
                                  "was changed; restore it (git checkout) or retrain (samcache.tasks.training)")
    return folder


def trained_model() -> pathlib.Path:
    """The shipped visual-QA checkpoint's folder, verified against its checksums."""
    return verify(SHIPPED)


def isolated_model() -> pathlib.Path:
    """The shipped visual-QA checkpoint with isolated image attention (its images' KV does not
    depend on their context: reused at any index exactly), verified against its checksums."""
    return verify(SHIPPED_ISOLATED)


def training_record(run) -> dict:
    """A training run's ``training.json``, with the runs it was fine-tuned from (``init_from``,
    followed while it names a training run rather than a shipped checkpoint, which carries its
    own record) as ``previous_stages``, oldest first: the whole recipe of what is shipped."""
    record = json.loads((pathlib.Path(run) / "training.json").read_text())
    stages, seen = [], {pathlib.Path(run).resolve()}
    parent = record.get("config", {}).get("init_from")
    while parent:
        folder = pathlib.Path(parent).resolve()
        if folder in seen or folder.parent == SHIPPED.parent.resolve() or not (folder / "training.json").is_file():
            break
        seen.add(folder)
        stage = json.loads((folder / "training.json").read_text())
        stages.insert(0, {k: v for k, v in stage.items() if k != "previous_stages"})
        parent = stage.get("config", {}).get("init_from")
    if stages:
        record["previous_stages"] = stages
    return record


def ship(trained, dest=SHIPPED) -> pathlib.Path:
    """Turn a training run's folder (float32, from :func:`samcache.tasks.training.train`) into a
    shipped checkpoint in ``dest``: weights in float16, the config saying so, the training record
    with the runs it continued (:func:`training_record`), every file checksummed."""
    import torch
    from safetensors.torch import load_file, save_file

    src, dest = pathlib.Path(trained), pathlib.Path(dest)
    absent = [n for n in FILES if not (src / n).is_file()]
    if absent:
        raise CheckpointError(f"{src} is not a finished training run: {', '.join(absent)} missing")
    dest.mkdir(parents=True, exist_ok=True)
    weights = load_file(src / "model.safetensors")
    save_file({k: v.to(torch.float16) if v.is_floating_point() else v for k, v in weights.items()},
              dest / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    for section in (config, config.get("text_config") or {}, config.get("vision_config") or {}):
        for key in ("torch_dtype", "dtype"):
            if key in section:
                section[key] = "float16"
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in FILES:
        if name not in ("model.safetensors", "config.json", "training.json"):
            shutil.copyfile(src / name, dest / name)
    (dest / "training.json").write_text(json.dumps(training_record(src), indent=2) + "\n")
    names = list(FILES)
    from samcache.profile.image_attention import declared

    if declared(dest).isolated:  # its reuse profile travels with it (made for the float16 weights)
        from samcache.profile.reuse_profile import PROFILE_FILE, make_profile, write_profile

        write_profile(make_profile(dest, None), dest)
        names.append(PROFILE_FILE)
    (dest / CHECKSUMS).write_text("".join(f"{_sha256(dest / n)}  {n}\n" for n in names))
    return verify(dest)


__all__ = ["CHECKSUMS", "FILES", "SHIPPED", "SHIPPED_ISOLATED", "CheckpointError", "isolated_model", "read_checksums",
           "ship", "trained_model", "training_record", "verify"]
