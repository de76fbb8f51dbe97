"""The documentation keeps up with the code: every flag `pretrain.py --help` lists appears in docs/*.md, and every
relative link in README.md and docs/*.md points to a file that exists."""
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.support.launch import assert_succeeded

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted((REPO / "docs").glob("*.md"))


def help_flags():
    """Every option string of `pretrain.py --help`, other spellings included (--foo, --foo-bar, --foo_bar)."""
    result = subprocess.run([sys.executable, "pretrain.py", "--help"], cwd=REPO, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert_succeeded(result, tail=2000)
    flags = set()
    for line in result.stdout.splitlines():
        if re.match(r"  -", line):  # an option's line: "  --foo FOO, --foo-bar FOO   help"
            invocation = re.split(r"\s{2,}", line.strip())[0]
            flags.update(part.split(" ")[0] for part in invocation.split(", "))
    return flags - {"-h", "--help"}


def test_every_help_flag_is_documented():
    flags = help_flags()
    assert len(flags) > 300, sorted(flags)  # the parser is read, not an empty or truncated --help
    docs = "\n".join(path.read_text() for path in DOCS)
    missing = sorted(flag for flag in flags if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", docs))
    assert not missing, f"{len(missing)} flags of pretrain.py --help appear in no docs/*.md page: {' '.join(missing)}"


def test_relative_links_point_to_files():
    broken = []
    for page in [REPO / "README.md", *DOCS]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            path = target.split("#")[0]
            if re.match(r"[a-z]+:", target) or not path:  # https:, mailto:, or a link within the page
                continue
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert not broken, "links to missing files:\n" + "\n".join(broken)
