"""tools/make_demo_corpus.py: English documents from the stdlib's docstrings and comments, deterministic,
cached, and never from test suites."""
import importlib.util
import json
import os
import subprocess
import sys
import sysconfig

import pytest

from tests.support.launch import REPO, assert_succeeded


def run_make_demo_corpus(output, *flags):
    return subprocess.run([sys.executable, "tools/make_demo_corpus.py", "--output", str(output), "--max-mb", "0.5",
                           *flags], cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "demo.jsonl"
    result = run_make_demo_corpus(path)
    assert_succeeded(result, tail=None)
    return path, result.stdout


def test_corpus_is_jsonl_of_many_english_documents(corpus):
    path, stdout = corpus
    texts = [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]
    assert f"wrote {len(texts)} documents" in stdout
    assert len(texts) > 100 and len(set(texts)) == len(texts)
    assert 0.3e6 < path.stat().st_size <= 0.5e6
    words = " ".join(texts).lower().split()
    for common in ("the", "of", "is", "to", "and", "return"):
        assert words.count(common) > 200, common


def test_two_builds_give_identical_bytes(corpus, tmp_path):
    path, _ = corpus
    again = tmp_path / "again.jsonl"
    assert run_make_demo_corpus(again).returncode == 0
    assert again.read_bytes() == path.read_bytes()


def test_an_existing_corpus_is_cached_unless_forced(corpus):
    path, _ = corpus
    before = path.stat().st_mtime_ns
    result = run_make_demo_corpus(path)
    assert result.returncode == 0 and "cached" in result.stdout
    assert path.stat().st_mtime_ns == before
    contents = path.read_bytes()
    forced = run_make_demo_corpus(path, "--force")
    assert forced.returncode == 0 and "wrote" in forced.stdout
    assert path.read_bytes() == contents
    assert os.listdir(path.parent) == [path.name]  # no temporary file left behind


def test_test_suites_and_installed_packages_are_skipped():
    spec = importlib.util.spec_from_file_location("make_demo_corpus", REPO / "tools" / "make_demo_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    stdlib = sysconfig.get_paths()["stdlib"]
    folders = {os.path.relpath(os.path.dirname(p), stdlib) for p in module.stdlib_sources(stdlib)}
    assert "json" in folders and "email" in folders
    for folder in folders:
        assert not {"test", "tests", "idle_test", "site-packages"} & set(folder.split(os.sep)), folder
