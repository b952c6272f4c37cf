"""The plugin as an SGLang user gets it: installed samcache, SGLang's own ``load_plugins()`` in a
fresh process, then ``--attention-backend samcache`` / ``--radix-cache-backend samcache`` parse,
the Qwen2.5-VL architecture resolves to samcache's override, the batch hook is applied; a version
of SGLang outside the supported range and bad settings fail clearly."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from importlib.metadata import entry_points

import pytest

from samcache.integrations import sglang as plugin

FRESH_PROCESS = r"""
import argparse
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang.srt.mem_cache.registry import registered_radix_cache_backends
from sglang.srt.models.registry import ModelRegistry
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
args = parser.parse_args(["--model-path", "m", "--attention-backend", "samcache", "--radix-cache-backend", "samcache"])
cls, arch = ModelRegistry.resolve_model_cls(["Qwen2_5_VLForConditionalGeneration"])
print("RESULT", args.attention_backend, args.radix_cache_backend, "samcache" in ATTENTION_BACKENDS,
      "samcache" in registered_radix_cache_backends(), cls.__module__, arch,
      getattr(ForwardBatch.init_new, "__wrapped__", None) is not None)
"""


def _fresh(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env}, cwd="/")


def test_entry_point_is_installed():
    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "samcache"]
    assert eps and eps[0].value == "samcache.integrations.sglang:register"


def test_load_plugins_registers_everything_in_a_fresh_process():
    out = _fresh(FRESH_PROCESS)
    line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT")), None)
    assert line is not None, out.stderr[-3000:]
    assert line.split()[1:] == ["samcache", "samcache", "True", "True", "samcache.integrations.sglang.models.qwen2_5_vl",
                                "Qwen2_5_VLForConditionalGeneration", "True"]


def test_plugin_off_switch():
    out = _fresh(FRESH_PROCESS, SAMCACHE_SGLANG_PLUGIN="0")
    assert out.returncode != 0 and "invalid choice" in out.stderr  # --attention-backend samcache is unknown


CHECK_REGISTERED = ("from sglang.srt.plugins import load_plugins; load_plugins()\n"
                    "from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS\n"
                    "print('REGISTERED', 'samcache' in ATTENTION_BACKENDS)")


def test_bad_settings_fail_registration_naming_the_key():
    # SGLang's load_plugins logs a failing plugin and goes on: nothing of samcache is registered,
    # so `--attention-backend samcache` is then refused by SGLang's argument parser.
    out = _fresh(CHECK_REGISTERED, SAMCACHE_SGLANG='{"recompute_ratoi": 0.1}')
    assert "unknown SAMCACHE_SGLANG key(s) ['recompute_ratoi']" in out.stderr
    assert "REGISTERED False" in out.stdout


@pytest.mark.parametrize("version", ["0.5.22", "0.4.9", "0.6.0", "1.0.0"])
def test_unsupported_version_fails_clearly(version):
    with pytest.raises(RuntimeError, match=rf"supports sglang>=0\.5\.23,<0\.6, this is sglang {version}"):
        plugin.check_version(version)


@pytest.mark.parametrize("version", ["0.5.23", "0.5.23.post1", "0.5.30rc1"])
def test_supported_versions(version):
    plugin.check_version(version)


def test_registration_refuses_an_unsupported_sglang_in_a_fresh_process():
    out = _fresh("import sglang; sglang.__version__ = '0.4.1'\n" + CHECK_REGISTERED)
    assert "the SGLang plugin supports sglang>=0.5.23,<0.6, this is sglang 0.4.1" in out.stderr
    assert "REGISTERED False" in out.stdout


def test_batch_hook_records_each_requests_isolation_keys():
    forward_batch = types.SimpleNamespace()
    batch = types.SimpleNamespace(reqs=[types.SimpleNamespace(extra_key="lora-a", cache_salt="salt-a"),
                                        types.SimpleNamespace(extra_key=None, cache_salt=None)])
    assert plugin._record_extra_keys(forward_batch, object, batch, None) is forward_batch
    assert forward_batch.samcache_extra_keys == [("lora-a", "salt-a"), (None, None)]
    assert forward_batch.samcache_agents == [(None, None), (None, None)]  # no rid or routing_key given
