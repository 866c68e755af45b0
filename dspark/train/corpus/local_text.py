"""Prompts whose material is text already on this machine: docstrings of installed Python
packages, man pages, and package descriptions (METADATA). Each item becomes a user request
built around it (implement, explain, summarize, use), so the target answers about real APIs
and real prose rather than template slots.
"""
from __future__ import annotations

import ast
import gzip
import random
import re
import sysconfig
from email.parser import Parser
from pathlib import Path

MAN_DIR = Path("/usr/share/man")


def site_package_dirs() -> list[Path]:
    paths = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], sysconfig.get_paths()["stdlib"]}
    return [Path(p) for p in sorted(paths) if Path(p).is_dir()]


def _first_paragraph(doc: str) -> str:
    return " ".join(doc.strip().split("\n\n")[0].split())


def python_docstrings(limit_files: int = 20000) -> list[tuple[str, str, str, str]]:
    """(module, function name, argument list, first docstring paragraph) of public functions, read with ast
    (nothing is imported)."""
    out = []
    files = sorted(f for d in site_package_dirs() for f in d.rglob("*.py") if "test" not in f.as_posix().lower())
    for path in files[:limit_files]:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        module = path.stem
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc:
                continue
            first = _first_paragraph(doc)
            if 30 <= len(first) <= 400 and first[0].isupper() and ">>>" not in first and ":param" not in first:
                args = ", ".join(a.arg for a in node.args.args if a.arg not in ("self", "cls"))
                out.append((module, node.name, args, first))
    out = [d for d in out if d[1] not in GENERIC_NAMES]
    return _capped(out, key=lambda item: item[0], per_key=3)


# Generated-code boilerplate (API clients have thousands of these), not worth a prompt each.
GENERIC_NAMES = {"to_str", "to_dict", "from_json", "from_dict", "to_json", "get", "set", "main", "run", "setup",
                 "validate", "openapi_types", "attribute_map"}


NAME_LINE = re.compile(r"^(?P<names>[\w.+\-, :\\]+?)\s*\\?[-\u2013]\s*(?P<desc>.{10,200})$")


def man_page_summaries(sections=("1", "3", "5", "8")) -> list[tuple[str, str, str]]:
    """(section, name, one-line description) from the NAME section of English man pages."""
    out = []
    for section in sections:
        folder = MAN_DIR / f"man{section}"
        if not folder.is_dir():
            continue
        for path in sorted(folder.iterdir()):
            try:
                opener = gzip.open if path.suffix == ".gz" else open
                with opener(path, "rt", encoding="utf-8", errors="replace") as f:
                    lines = f.read(20000).splitlines()
            except (OSError, EOFError):
                continue
            for i, line in enumerate(lines):
                if line.strip().upper().startswith((".SH NAME", '.SH "NAME"', ".SH\tNAME")):
                    body = " ".join(x for x in lines[i + 1:i + 4] if x and not x.startswith(".") or x.startswith(".Nd"))
                    body = re.sub(r"\\f[BIRP]|\\&|\\\(em|\\\(en", "", body).replace("\\-", "-").replace(".Nd", "-")
                    m = NAME_LINE.match(" ".join(body.split()))
                    if m:
                        name = m.group("names").split(",")[0].strip()
                        desc = re.sub(r"\s*(Standard C library|Math library).*$", "", m.group("desc")).strip()
                        if " " not in name and len(desc) >= 10:
                            out.append((section, name, desc.rstrip(".")))
                    break
    return _capped(out, key=lambda item: re.split(r"[-_.]", item[1])[0], per_key=3)


def _capped(items: list, key, per_key: int) -> list:
    """At most per_key items per key, so one big family (gcloud's 10,000 pages) cannot swamp the rest."""
    counts, out = {}, []
    for item in items:
        k = key(item)
        counts[k] = counts.get(k, 0) + 1
        if counts[k] <= per_key:
            out.append(item)
    return out


def package_descriptions() -> list[tuple[str, str, list[str]]]:
    """(package, summary, prose paragraphs of its long description) from installed METADATA files."""
    out = []
    for d in site_package_dirs():
        for meta in sorted(d.glob("*.dist-info/METADATA")):
            msg = Parser().parsestr(meta.read_text(encoding="utf-8", errors="replace"))
            body = msg.get_payload() if not msg.is_multipart() else ""
            paras = []
            for p in re.split(r"\n\s*\n", body or ""):
                text = " ".join(p.split())
                # Prose only: no code, tables, links-only lines or headings.
                if 200 <= len(text) <= 1200 and not re.search(r"[`|<>{}]|http|^#|^\.\. |\$ ", text):
                    paras.append(text)
            out.append((msg.get("Name", meta.parent.name), msg.get("Summary", "") or "", paras))
    return out


DOCSTRING_REQUESTS = [
    "Write a Python function `{name}({args})` that does this: {doc}",
    "Implement `{name}({args})` in plain Python. Specification: {doc} Add a docstring and an example call.",
    "Here is the description of a function from the `{module}` module: \"{doc}\" Explain what it is for and when "
    "someone would use it.", "Write unit tests for a function `{name}({args})` described as: {doc}",
    "How would you implement this in JavaScript? {doc}", "Write a Rust function `{name}` that does this: {doc}",
]
MAN_REQUESTS = {
    "1": ["How do I use the `{name}` command ({desc})? Show a few examples.", "What does `{name}` do on Linux? "
          "Explain its most useful options.", "Write a shell script that uses `{name}` to {desc_lower}."],
    "8": ["As a system administrator, how would I use `{name}` ({desc})?", "Explain the Linux tool `{name}`: {desc}."],
    "5": ["Explain the format of the file described by `{name}` ({desc}) with an example.",
          "What is `{name}` for? ({desc})"],
    "3": ["Write a C program that demonstrates `{name}` ({desc}).", "Explain the C library function `{name}`: {desc}. "
          "What are common pitfalls?", "How is `{name}` used in C? The manual says: {desc}."],
}
PARAGRAPH_REQUESTS = [
    "Summarize the following text in two sentences:\n\n{p}", "Rewrite this paragraph in simpler words:\n\n{p}",
    "Write three questions a reader might ask about this text, and answer them:\n\n{p}",
    "What is the main idea of this paragraph?\n\n{p}", "Turn this description into a bulleted list of key "
    "points:\n\n{p}", "Translate this into plain English for a non-programmer:\n\n{p}",
]
PACKAGE_REQUESTS = ["What is the Python package `{name}` used for? Its summary: \"{summary}\". Show a typical "
                    "usage example.", "I need {summary_lower}. Which approach would you take in Python, and why?"]


def local_text_prompts(n_doc: int, n_man: int, n_para: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    docs = python_docstrings() if n_doc else []
    for module, name, args, doc in rng.sample(docs, min(n_doc, len(docs))):
        out.append(dict(source="docstrings", category="code",
                        turns=[rng.choice(DOCSTRING_REQUESTS).format(module=module, name=name, args=args, doc=doc)]))
    mans = man_page_summaries() if n_man else []
    for section, name, desc in rng.sample(mans, min(n_man, len(mans))):
        text = rng.choice(MAN_REQUESTS[section if section in MAN_REQUESTS else "1"])
        out.append(dict(source="man_pages", category="code" if section == "3" else "chat",
                        turns=[text.format(name=name, desc=desc, desc_lower=desc[:1].lower() + desc[1:])]))
    packages = package_descriptions() if n_para else []
    paragraphs = [p for _, _, paras in packages for p in paras]
    for p in rng.sample(paragraphs, min(n_para, len(paragraphs))):
        out.append(dict(source="package_docs", category="writing", turns=[rng.choice(PARAGRAPH_REQUESTS).format(p=p)]))
    for name, summary, _ in packages:
        summary = summary.strip().rstrip(".")
        if len(summary) >= 15:
            out.append(dict(source="package_docs", category="code", turns=[rng.choice(PACKAGE_REQUESTS).format(
                name=name, summary=summary, summary_lower=summary[:1].lower() + summary[1:])]))
    return out
