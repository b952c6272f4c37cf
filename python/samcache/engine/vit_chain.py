"""The ViT cache chain: vision-tower outputs by image content, kept on the device, in host memory
and on disk (each letting go into the next, lossless), found in a shared store where another
instance encoded the image, and computed in one batched vision-tower call for the rest.

Keys carry the tenant (a hit would tell one tenant, through its TTFT and metrics, that another
has sent this image). Outputs read back from host memory, disk or the shared store are checked
against the image's patch grid and the model's shapes before use.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from samcache.engine.metrics import TurnMetrics
from samcache.engine.prompt import Prompt
from samcache.engine.runner import ModelRunner
from samcache.hashing import Namespace
from samcache.cache.stores import TensorStore


class VitChain:
    """ViT outputs for ``runner``'s model: ``store`` on the device (``device_bytes``), then
    ``host`` (``host_bytes`` of CPU tensors; 0: none), then ``disk`` (a DiskTier; its items framed
    under ``disk_namespace``); ``lower`` (the image-KV store's LowerTiers, or None) reaches the
    shared store, if it has one."""

    def __init__(self, runner: ModelRunner, processor, *, device_bytes: int, host_bytes: int = 0, disk=None,
                 disk_namespace: Namespace | None = None, lower=None, name: str = "vit") -> None:
        self.runner = runner
        self.processor = processor
        self.disk = disk
        self.disk_namespace = disk_namespace
        self.lower = lower
        to_disk = self._to_disk if disk is not None else None
        self.host = TensorStore(f"{name}-host", host_bytes, spill=to_disk) if host_bytes else None
        self.store = TensorStore(name, device_bytes, spill=self._to_host if self.host is not None else to_disk)

    def ensure(self, prompt: Prompt, image_indices: Sequence[int], vit: dict, m: TurnMetrics, options,
               namespace: Namespace | None = None) -> None:
        """Fill ``vit`` (image index -> output) for these images: from the chain
        (``options.use_vit``, in ``options.vit_namespace`` or ``namespace``), else one batched
        vision-tower call, whose outputs ``options.store_vit`` keeps (and publishes to the shared
        store)."""
        namespace = options.vit_namespace or namespace
        remote = self.lower.remote if self.lower is not None and options.use_vit else None
        missing = []
        for i in image_indices:
            if i in vit:
                continue
            span = prompt.images[i]
            hit = self._find(namespace.key(span.image.content), span, m, options, namespace, remote)
            if hit is not None:
                vit[i] = hit
                m.vit_hits += 1
            else:
                missing.append(i)
        if missing:
            self._encode(prompt, missing, vit, m, options, namespace, remote)

    def _find(self, key, span, m: TurnMetrics, options, namespace: Namespace, remote) -> tuple | None:
        """The output from the first level that holds it; one found below the device is kept on
        the device again (``options.store_vit``)."""
        if not options.use_vit:
            return None
        hit = self.store.get(key, check=span.image.grid)
        if hit is not None:
            return hit
        if self.host is not None:
            host = self.host.get(key, check=span.image.grid)
            if host is not None:
                r = self.runner
                hit = host[0].to(r.device, r.dtype), tuple(t.to(r.device, r.dtype) for t in host[1])
                m.vit_host_hits += 1
        if hit is None and self.disk is not None:
            hit = self._read(self.disk.get_tensors(self.disk_namespace, key), span)
            m.vit_disk_hits += hit is not None
        if hit is None and remote is not None:  # another instance may have encoded it
            hit = self._read(remote.get_tensors(namespace, key, "vit"), span)
            m.vit_remote_hits += hit is not None
        if hit is not None and options.store_vit:
            self.store.put(key, hit, check=span.image.grid)
        return hit

    def _encode(self, prompt: Prompt, missing: list[int], vit: dict, m: TurnMetrics, options, namespace: Namespace,
                remote) -> None:
        pixels = [prompt.images[i].image.pixels for i in missing]
        # Always HxWx3: left to guess, the processor reads a 1- or 3-pixel-tall image as channels-first.
        if self.runner.family.vision_input == "tiles":  # InternVL: tiles (and a thumbnail) per image
            inputs = self.processor.image_processor(images=pixels, return_tensors="pt", input_data_format="channels_last",
                                                    crop_to_patches=True)
            outputs = self.runner.encode_images(inputs["pixel_values"], torch.as_tensor(inputs["num_patches"]))
        else:
            inputs = self.processor.image_processor(images=pixels, return_tensors="pt",
                                                    input_data_format="channels_last")
            outputs = self.runner.encode_images(inputs["pixel_values"], inputs["image_grid_thw"])
        for i, out in zip(missing, outputs):
            span = prompt.images[i]
            if tuple(out[0].shape) != (span.length, self.runner.hidden_size):
                raise RuntimeError(f"vision tower returned {tuple(out[0].shape)} for an image of {span.length} tokens")
            vit[i] = out
            m.vit_calls += 1
            if options.use_vit and options.store_vit:
                self.store.put(namespace.key(span.image.content), out, check=span.image.grid)
            if remote is not None and options.store_vit:  # what this instance encoded, others reuse (written off-thread)
                self.lower.publish_tensors(namespace, namespace.key(span.image.content), "vit", [out[0], *out[1]],
                                           {"check": [int(v) for v in span.image.grid]})

    def _to_host(self, key, out: tuple, grid) -> None:
        """An output the device cache lets go, to host memory; what host memory cannot hold goes on down."""
        if not self.host.put(key, (out[0].cpu(), tuple(t.cpu() for t in out[1])), check=grid) and self.disk is not None:
            self._to_disk(key, out, grid)

    def _to_disk(self, key, out: tuple, grid) -> None:
        self.disk.put_tensors(self.disk_namespace, key, [out[0], *out[1]], {"check": [int(v) for v in grid]})

    def _read(self, got: tuple[list, dict] | None, span) -> tuple | None:
        """A record read back from disk or the shared store, if its patch grid and shapes match."""
        if got is None:
            return None
        tensors, meta = got
        r = self.runner
        if (meta.get("check") != [int(v) for v in span.image.grid] or len(tensors) != 1 + r.deepstack_layers
                or tuple(tensors[0].shape) != (span.length, r.hidden_size)):
            return None
        return tensors[0].to(r.device, r.dtype), tuple(t.to(r.device, r.dtype) for t in tensors[1:])

    def check_invariants(self) -> None:
        self.store.check_invariants()
        if self.host is not None:
            self.host.check_invariants()
