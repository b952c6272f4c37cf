"""The SGLang plugin's tests run in SGLang's environment (`make test` runs them with
.venv-sglang's python). Anywhere SGLang is not installed, they are not collected."""

import importlib.util

if importlib.util.find_spec("sglang") is None:
    collect_ignore_glob = ["test_*.py"]
