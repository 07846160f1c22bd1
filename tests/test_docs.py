"""The docs say what is true where a test can tell: every commit they cite for a measurement is in the history
(a stamp naming a commit that never landed cannot be rerun)."""

import re
import subprocess

import pytest

from tests.helpers import ROOT

COMMIT = re.compile(r"`([0-9a-f]{7,40})`")
"""A commit as the docs stamp one: hex in backticks (a hash of seven or more digits)."""


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


def cited_commits() -> dict[str, list[str]]:
    """``{commit: [file:line, ...]}`` for every stamp in README.md and docs/."""
    cited: dict[str, list[str]] = {}
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for commit in COMMIT.findall(line):
                if re.search(r"[a-f]", commit) and re.search(r"[0-9]", commit):
                    cited.setdefault(commit, []).append(f"{path.relative_to(ROOT)}:{n}")
    return cited


@pytest.mark.skipif(git("rev-parse", "--is-shallow-repository").stdout.strip() != "false",
                    reason="needs the whole history (not a git checkout, or a shallow clone)")
def test_every_commit_the_docs_cite_is_in_the_history():
    cited = cited_commits()
    assert cited, "the docs stamp their measurements with commits"
    missing = {c: where for c, where in cited.items() if git("cat-file", "-e", f"{c}^{{commit}}").returncode != 0}
    assert not missing, f"commits cited in the docs that are not in the history: {missing}"


def test_docs_extending_names_only_what_the_contract_has():
    """docs/extending.md's paragraphs on the drafter contract name its fields and methods in backticks: each must be
    one the spec, a behaviour protocol or the recipe bases declare (issue 54: it named a hook, ``attach_states``,
    that no longer existed), and every method a behaviour protocol declares is named."""
    from draftheads.drafters.contract import Artifacts, FeatureRecipe, Recipe, Serving, Training
    from draftheads.drafters.spec import DrafterSpec
    text = (ROOT / "docs" / "extending.md").read_text()
    paragraph = text[text.index("The recipe is two things"):text.index("Then one line in")]
    names = set(re.findall(r"`([a-z_]+)`", paragraph))
    protocols = (Training, Artifacts, Serving)
    declared = {n for cls in (DrafterSpec, *protocols, Recipe, FeatureRecipe)
                for n in (*vars(cls), *getattr(cls, "__annotations__", {}))}
    assert names and not names - declared, f"docs/extending.md names what the contract lacks: {names - declared}"
    behaviour = {n for cls in protocols for n, v in vars(cls).items() if callable(v) and not n.startswith("_")}
    assert not behaviour - names, f"docs/extending.md does not name {behaviour - names}"


def test_the_readmes_headline_tau_is_the_stamped_table_of_docs_medusa():
    """The README quotes the main job's chain and tree tau with their intervals: the numbers of the table in
    docs/medusa.md's results (each number lives there; a quote that drifts from it is a defect)."""
    readme = (ROOT / "README.md").read_text()
    table = (ROOT / "docs" / "medusa.md").read_text()
    quoted = re.findall(r"(chain|tree) tau \*\*([\d.]+) \[([\d.]+), ([\d.]+)\]\*\*", readme)
    assert {m for m, *_ in quoted} == {"chain", "tree"}, quoted
    held_out = re.search(r"on \d+ held-out (\w+) prompts, chain tau", readme).group(1)  # the headline's set
    for method, tau, lo, hi in quoted:
        row = rf"{held_out}\s+medusa_{method}\s+{re.escape(tau)} \[{re.escape(lo)},{re.escape(hi)}\]"
        assert re.search(row, table), (method, tau, lo, hi)


def test_ci_runs_the_readmes_test_command_verbatim():
    """``.ci/run`` holds README's test set-up command, after its venv line, as one line of its own: CI checks the
    command a newcomer copies, not a neighbour of it."""
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"Install and run the tests:\n\n```bash\n(.+)\n```", readme).group(1)
    after_venv = command.split(" && ", 2)[2]  # past `python3 -m venv .venv && . .venv/bin/activate`
    assert after_venv in (ROOT / ".ci" / "run").read_text().splitlines()
