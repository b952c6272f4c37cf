"""docs/api.md matches the code.

(a) Every dotted ``samcache.x.y`` name the reference writes in backticks resolves: the longest
    importable module prefix is imported and the rest is looked up attribute by attribute (a
    dataclass's fields count as its attributes). So do the module cells of its "| module | names |"
    tables, including the relative ones (``.attention`` under ``samcache.integrations.sglang``), and
    the ``from samcache... import ...`` lines of its fenced examples (and of README.md's).
(b) Every public name is documented: each name in ``samcache.__all__``, and in the ``__all__`` of
    every package the reference mentions and of every module a section heading names, appears as
    a whole word inside some code span (inline or fenced) of the reference.
(c) The ``SAMcacheEngine(...)`` signature line lists exactly the constructor's parameters, the
    settings-group table lists exactly the fields of each group with their flat keywords, and the
    examples (api.md's and README.md's) pass SAMcacheEngine only keywords it takes.

Each check collects every problem and fails once, listing them all. The checkers take the text as an
argument, so the last tests feed them a deliberately broken copy and make sure they complain.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import re
from pathlib import Path

API_MD = Path(__file__).resolve().parents[1] / "docs" / "api.md"

FENCE = re.compile(r"^```.*?^```[ \t]*$", re.M | re.S)
INLINE = re.compile(r"(`+)((?:(?!\n\s*\n)[^`]|(?!\1)`)+?)\1", re.S)  # `code`, ``a ` inside``; may wrap lines
DOTTED = re.compile(r"(?<![\w./\-])samcache(?:\.[A-Za-z_]\w*)+")
RELATIVE = re.compile(r"^(\.[A-Za-z_]\w*)+$")
WORD = re.compile(r"[A-Za-z_]\w*")


def read_doc() -> str:
    return API_MD.read_text(encoding="utf-8")


def inline_spans(text: str) -> list[str]:
    """Inline code spans, outside fenced blocks (a table's escaped pipe becomes a pipe)."""
    prose = FENCE.sub("", text)
    return [" ".join(m.group(2).replace("\\|", "|").split()) for m in INLINE.finditer(prose)]


def code_words(text: str) -> set[str]:
    """Every identifier written in code: inline spans and fenced blocks."""
    words = set()
    for span in inline_spans(text):
        words.update(WORD.findall(span))
    for block in FENCE.findall(text):
        words.update(WORD.findall(block))
    return words


def top_level_names(path: str) -> set[str]:
    """Names a module's source binds at top level (for modules whose imports are not installed)."""
    names = set()
    for node in ast.parse(Path(path).read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def resolve(dotted: str) -> None:
    """Import the longest module prefix of `dotted` and getattr the rest; raise on failure.

    A module that exists but imports an optional dependency that is not installed here (vLLM,
    SGLang) is read instead: its source must bind the next name at top level."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(name)
        except ModuleNotFoundError as e:
            missing = e.name or ""
            if missing == name or name.startswith(missing + "."):
                continue  # no module of that name: try a shorter prefix
            if missing.split(".")[0] == "samcache":
                raise
            spec = importlib.util.find_spec(name)
            if len(parts) > i and parts[i] not in top_level_names(spec.origin):
                raise AttributeError(f"{name} (not importable here: needs {missing}) defines no {parts[i]!r}") from None
            return
        break
    else:
        raise ModuleNotFoundError(f"no module {parts[0]!r}")
    for attr in parts[i:]:
        if isinstance(obj, type) and dataclasses.is_dataclass(obj) and attr in {f.name for f in dataclasses.fields(obj)}:
            return  # a field without a default is no class attribute
        if not hasattr(obj, attr):
            kind = "module" if inspect.ismodule(obj) else type(obj).__name__
            raise AttributeError(f"{kind} {getattr(obj, '__name__', obj)!s} has no attribute or submodule {attr!r}")
        obj = getattr(obj, attr)


def dotted_names(text: str) -> list[str]:
    names = []
    for span in inline_spans(text):
        names.extend(DOTTED.findall(span))
    return sorted(set(names))


def module_cells(text: str) -> list[str]:
    """Absolute module paths of every "| module | names |" table's first column."""
    modules, in_table, base = [], False, None
    for line in text.splitlines():
        if not line.startswith("|"):
            in_table, base = False, None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == "module":
            in_table = True
            continue
        if not in_table:
            continue
        for span in INLINE.findall(cells[0]):
            path = span[1]
            if path.startswith("samcache."):
                base = path
                modules.append(path)
            elif RELATIVE.match(path) and base is not None:
                modules.append(base + path)
    return modules


def fenced_imports(text: str) -> list[str]:
    """`from samcache.x import A, B` in the fenced code blocks, as dotted names (samcache.x.A, ...)."""
    names = []
    for block in FENCE.findall(text):
        for m in re.finditer(r"^\s*from\s+(samcache[\w.]*)\s+import\s+([\w, ]+)$", block, re.M):
            names.extend(f"{m.group(1)}.{n.strip()}" for n in m.group(2).split(",") if n.strip())
        for m in re.finditer(r"^\s*import\s+(.+)$", block, re.M):
            names.extend(n.strip() for n in m.group(1).split(",") if n.strip().startswith("samcache."))
    return names


def unresolved(text: str) -> list[str]:
    """Dotted names, module cells and fenced-code imports of `text` that do not resolve, with the reason."""
    problems = []
    for name in sorted(set(dotted_names(text)) | set(module_cells(text)) | set(fenced_imports(text))):
        try:
            resolve(name)
        except (ImportError, AttributeError) as e:
            problems.append(f"{name}: {type(e).__name__}: {e}")
    return problems


def documented_modules(text: str) -> list[str]:
    """samcache, every package the text names, and every module a section heading names."""
    headings = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    in_headings = set(DOTTED.findall(headings))
    modules = {"samcache"}
    for name in set(dotted_names(text)) | set(module_cells(text)) | in_headings:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue  # an attribute, not a module (test_dotted_names_resolve checks it exists)
        if hasattr(module, "__path__") or name in in_headings:
            modules.add(name)
    return sorted(modules)


def undocumented(text: str) -> dict[str, list[str]]:
    """Per module with an __all__: the names of it the text never writes in code."""
    words = code_words(text)
    missing = {}
    for name in documented_modules(text):
        public = getattr(importlib.import_module(name), "__all__", None)
        if public is None:
            continue
        absent = sorted(n for n in public if n not in words)
        if absent:
            missing[name] = absent
    return missing


def engine_signature_problems(text: str) -> list[str]:
    """The documented SAMcacheEngine(...) line and settings groups against the code."""
    from samcache.engine import SAMcacheEngine, config

    problems = []
    documented = None
    for span in inline_spans(text):
        if span.startswith("SAMcacheEngine(model_path"):
            documented = span
            break
    if documented is None:
        return ["no `SAMcacheEngine(model_path, ...)` signature line in docs/api.md"]
    doc_params = {m.group(1) for m in re.finditer(r"(?:\(|,)\s*(?:\*\*)?(\w+)\s*(?==|,|\))", documented)}
    code_params = {p for p in inspect.signature(SAMcacheEngine.__init__).parameters if p != "self"}
    for p in sorted(code_params - doc_params):
        problems.append(f"SAMcacheEngine parameter {p!r} is missing from the documented signature")
    for p in sorted(doc_params - code_params):
        problems.append(f"documented SAMcacheEngine parameter {p!r} does not exist")

    rows = {}
    for line in text.splitlines():
        m = re.match(r"\|\s*`(\w+Config)`\s*\|(.*)\|\s*$", line)
        if m:
            rows[m.group(1)] = m.group(2)
    groups = {"CacheConfig", "RecomputeConfig", "CompressionConfig", "TierConfig", "EvictionConfig"}
    flat = {(group, field): kw for kw, (group, field) in config.KEYWORDS.items()}
    attr_of = {"CacheConfig": "cache", "RecomputeConfig": "recompute", "CompressionConfig": "compression",
               "TierConfig": "tiers", "EvictionConfig": "eviction"}
    for group in sorted(groups):
        cls = getattr(config, group)
        if group not in rows:
            problems.append(f"settings group {group} has no row in the groups table")
            continue
        cell = rows[group]
        doc_fields = dict(re.findall(r"`(\w+)`(?:\s*\(`(\w+)`\))?\s*=", cell))
        code_fields = {f.name for f in dataclasses.fields(cls)}
        for f in sorted(code_fields - set(doc_fields)):
            problems.append(f"{group}.{f} is missing from the groups table")
        for f in sorted(set(doc_fields) - code_fields):
            problems.append(f"{group}.{f} is documented but is no field of {group}")
        for f in sorted(code_fields & set(doc_fields)):
            keyword = flat.get((attr_of[group], f))
            written = doc_fields[f] or f
            if keyword != written:
                problems.append(f"{group}.{f}: flat keyword is {keyword!r}, the table says {written!r}")
    return problems


def engine_call_problems(text: str) -> list[str]:
    """Keywords passed to SAMcacheEngine(...) in fenced code that the constructor does not take."""
    from samcache.engine import SAMcacheEngine, config

    accepted = set(inspect.signature(SAMcacheEngine.__init__).parameters) | set(config.KEYWORDS)
    problems = []
    for block in FENCE.findall(text):
        for call in re.finditer(r"SAMcacheEngine\(", block):
            depth, top = 0, []  # the call's own arguments, nested calls left out
            for ch in block[call.end() - 1:]:
                depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(ch, 0)
                if depth == 0:
                    break
                if depth == 1 or (depth == 2 and ch in "([{"):
                    top.append(ch)
            for kw in re.findall(r"[(,]\s*(\w+)\s*=(?!=)", "".join(top)):
                if kw not in accepted:
                    problems.append(f"SAMcacheEngine(... {kw}=...) : no such parameter or settings keyword")
    return problems


def report(problems) -> str:
    if isinstance(problems, dict):
        problems = [f"{module}: {', '.join(names)}" for module, names in problems.items()]
    return "\n  " + "\n  ".join(problems)


# --- the checks on docs/api.md ---------------------------------------------------------------------


def test_dotted_names_resolve():
    problems = unresolved(read_doc())
    assert not problems, "docs/api.md names that do not exist:" + report(problems)


def test_public_names_documented():
    missing = undocumented(read_doc())
    assert not missing, "public names (__all__) docs/api.md never mentions:" + report(missing)


def test_engine_constructor_documented():
    problems = engine_signature_problems(read_doc())
    assert not problems, "SAMcacheEngine's documented settings differ from the code:" + report(problems)


def test_readme_examples_use_what_exists():
    readme = API_MD.parents[1] / "README.md"
    text = readme.read_text(encoding="utf-8")
    problems = unresolved(text) + engine_call_problems(text) + engine_call_problems(read_doc())
    assert not problems, "README.md / docs/api.md examples that do not match the code:" + report(problems)


def test_the_checks_see_the_whole_reference():
    text = read_doc()
    assert len(dotted_names(text)) > 50
    assert {"samcache", "samcache.engine", "samcache.ops", "samcache.recompute"} <= set(documented_modules(text))


# --- the checks can fail ---------------------------------------------------------------------------


def test_a_name_that_does_not_exist_is_reported():
    text = read_doc() + "\n`samcache.hashing.no_such_function` and `samcache.no_such_module.thing`\n"
    problems = unresolved(text)
    assert any(p.startswith("samcache.hashing.no_such_function:") for p in problems), problems
    assert any(p.startswith("samcache.no_such_module.thing:") for p in problems), problems
    text = read_doc() + "\n```python\nfrom samcache.engine import SAMcacheEngine, NoSuchThing\n```\n"
    assert any(p.startswith("samcache.engine.NoSuchThing:") for p in unresolved(text))


def test_an_unknown_engine_keyword_in_an_example_is_reported():
    text = ("```python\nengine = SAMcacheEngine(path, cache=CacheConfig(num_blocks=8), recompute_ratio=0.05,\n"
            "    turbo_mode=True)\n```\n")
    assert engine_call_problems(text) == ["SAMcacheEngine(... turbo_mode=...) : no such parameter or settings keyword"]


def test_a_wrong_relative_module_cell_is_reported():
    text = read_doc() + "\n| module | names |\n| --- | --- |\n| `samcache.integrations.sglang` | x |\n| `.nowhere` | y |\n"
    assert any(p.startswith("samcache.integrations.sglang.nowhere:") for p in unresolved(text))


def test_a_public_name_left_out_is_reported():
    text = read_doc()
    assert "hash_bytes" in code_words(text)
    broken = re.sub(r"\bhash_bytes\b", "hash_b", text)
    assert "hash_bytes" in undocumented(broken).get("samcache", [])
    broken = re.sub(r"\bsolve_layer_budget\b", "solve_budget", text)
    assert "solve_layer_budget" in undocumented(broken).get("samcache.recompute", [])


def test_a_wrong_engine_signature_is_reported():
    text = read_doc()
    broken = text.replace("max_step_tokens=16384, seed=0,", "max_step_tokens=16384, seed=0, turbo=True,", 1)
    assert broken != text
    assert any("'turbo' does not exist" in p for p in engine_signature_problems(broken))
    broken = re.sub(r"`prefetch_horizon`=2", "", text, count=1)
    assert any("EvictionConfig.prefetch_horizon is missing" in p for p in engine_signature_problems(broken))
