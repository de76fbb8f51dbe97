"""Build a small corpus of real English text from the Python standard library's own sources.

    python tools/make_demo_corpus.py --output data/demo_corpus.jsonl

Every machine with Python has this text, so demos and tests need no download. The stdlib's .py files
(test suites and site-packages left out) are parsed with `ast` and `tokenize`, never imported. Documents:
one per module (its docstring and its functions'), one per class (its docstring and its methods'), one
per module of its longer comment blocks, and the language reference sections that pydoc_data/topics.py
holds. Short and duplicate documents are dropped; files are read in sorted order, so the same Python
gives the same bytes (about 3.8 MB on CPython 3.11). Output: one {"text": ...} JSON object a line.
"""
import argparse
import ast
import io
import json
import os
import sysconfig
import tokenize
import warnings

SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
MIN_DOCUMENT_CHARS = 300
MIN_COMMENT_BLOCK_CHARS = 80  # shorter ones are mostly notes on one line of code


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", default="data/demo_corpus.jsonl")
    parser.add_argument("--max-mb", type=float, default=8.0, help="stop once the corpus reaches this size")
    parser.add_argument("--force", action="store_true", help="rebuild even if --output exists")
    return parser.parse_args(argv)


def stdlib_sources(stdlib_dir):
    """The stdlib's .py files in a fixed order, without test suites and installed packages."""
    for root, dirs, files in os.walk(stdlib_dir):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
        for name in sorted(files):
            if name.endswith(".py"):
                yield os.path.join(root, name)


def read_source(path):
    """(source bytes, AST), or None for files that are not valid Python 3 (a few are, deliberately)."""
    try:
        with open(path, "rb") as f, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences in old docstrings
            source = f.read()
            return source, ast.parse(source, filename=path)
    except (SyntaxError, ValueError, OSError):
        return None


def joined_docstrings(node, children):
    parts = [ast.get_docstring(node) or ""] + [ast.get_docstring(child) or "" for child in children]
    return "\n\n".join(part.strip() for part in parts if part.strip())


def docstring_documents(tree):
    """The module document (module and top-level function docstrings), then one document per class."""
    functions = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    yield joined_docstrings(tree, functions)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            yield joined_docstrings(node, methods)


def comment_document(source):
    """The module's longer comment blocks (runs of consecutive comment lines), one paragraph each."""
    blocks, block, previous_row = [], [], None
    try:
        for token in tokenize.tokenize(io.BytesIO(source).readline):
            if token.type != tokenize.COMMENT or token.string.startswith("#!"):
                continue
            if block and token.start[0] != previous_row + 1:
                blocks.append("\n".join(block))
                block = []
            block.append(token.string.lstrip("#").strip())
            previous_row = token.start[0]
    except (tokenize.TokenError, SyntaxError):
        return ""
    blocks.append("\n".join(block))
    return "\n\n".join(b for b in blocks if len(b) >= MIN_COMMENT_BLOCK_CHARS)


def reference_topics(tree):
    """The language reference sections that pydoc_data/topics.py holds as one dict literal, by name."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["topics"]:
            try:
                topics = ast.literal_eval(node.value)
            except (ValueError, TypeError, SyntaxError):  # no longer a plain literal: skip it
                return
            yield from (topics[name] for name in sorted(topics) if isinstance(topics[name], str))


def source_documents(path, source, tree):
    yield from docstring_documents(tree)
    yield comment_document(source)
    if path.endswith(os.path.join("pydoc_data", "topics.py")):
        yield from reference_topics(tree)


def corpus_documents(stdlib_dir):
    """Every distinct document of natural length, in a deterministic order."""
    seen = set()
    for path in stdlib_sources(stdlib_dir):
        parsed = read_source(path)
        for document in source_documents(path, *parsed) if parsed else ():
            document = document.strip()
            if len(document) >= MIN_DOCUMENT_CHARS and document not in seen:
                seen.add(document)
                yield document


def write_corpus(documents, output, max_bytes):
    """Write JSON lines up to max_bytes to a temporary name, then rename; returns (documents, bytes)."""
    count = size = 0
    temporary = f"{output}.tmp-{os.getpid()}"
    try:
        with open(temporary, "w", encoding="utf-8", newline="\n") as out:
            for document in documents:
                line = json.dumps({"text": document}, ensure_ascii=False) + "\n"
                line_bytes = len(line.encode("utf-8"))
                if size + line_bytes > max_bytes:
                    break
                out.write(line)
                count, size = count + 1, size + line_bytes
        os.replace(temporary, output)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
    return count, size


def main(argv=None):
    args = parse_args(argv)
    if os.path.exists(args.output) and not args.force:
        print(f"{args.output} exists (cached); pass --force to rebuild it")
        return
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    stdlib_dir = sysconfig.get_paths()["stdlib"]
    count, size = write_corpus(corpus_documents(stdlib_dir), args.output, int(args.max_mb * 1e6))
    print(f"wrote {count} documents, {size / 1e6:.2f} MB, from the Python sources under {stdlib_dir} "
          f"to {args.output}")


if __name__ == "__main__":
    main()
