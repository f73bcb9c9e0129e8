"""The documented third-party family (docs/examples/lollm-toy): install it, run it, hold it to the conformance kit.

The example is copied out of the repository, installed with ``pip install
--target`` into a private folder, and driven in child processes that see
that folder; the test venv never changes.
"""

from __future__ import annotations

import json
import re
import shutil
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from _core_helpers import child_env, pip_install, run_lollm, run_python, write_tiny_tokenizer

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "lollm-toy"

CONFIG = {
    "model_type": "lollm_toy",
    "architectures": ["ToyForCausalLM"],
    "vocab_size": 320,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 128,  # the kit decodes past position 64 (its coverage check)
    "eos_token_id": 0,
}


def toy_tensors(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights for every tensor the toy model has, by the names its files use."""
    g = torch.Generator().manual_seed(seed)
    h, V, P = config["hidden_size"], config["vocab_size"], config["max_position_embeddings"]

    def rnd(*shape, scale=0.3):
        return torch.randn(*shape, generator=g) * scale

    t = {
        "model.embed_tokens.weight": rnd(V, h, scale=1.0),
        "model.embed_positions.weight": rnd(P, h),
        "model.norm.weight": 1 + rnd(h, scale=0.1),
        "model.norm.bias": rnd(h, scale=0.1),
        "lm_head.weight": rnd(V, h),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for ln in ("ln_1", "ln_2"):
            t[p + ln + ".weight"] = 1 + rnd(h, scale=0.1)
            t[p + ln + ".bias"] = rnd(h, scale=0.1)
        for proj in "qkvo":
            t[p + f"self_attn.{proj}_proj.weight"] = rnd(h, h)
            t[p + f"self_attn.{proj}_proj.bias"] = rnd(h, scale=0.1)
        t[p + "mlp.fc_in.weight"] = rnd(4 * h, h)
        t[p + "mlp.fc_in.bias"] = rnd(4 * h, scale=0.1)
        t[p + "mlp.fc_out.weight"] = rnd(h, 4 * h)
        t[p + "mlp.fc_out.bias"] = rnd(h, scale=0.1)
    return t


def write_toy_checkpoint(folder: Path, config: dict = CONFIG) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(toy_tensors(config), str(folder / "model.safetensors"))
    write_tiny_tokenizer(folder, vocab_size=config["vocab_size"], chat_template=False)
    return folder


def install_copy(source: Path, root: Path, name: str, patch=None) -> Path:
    """Copy a project out of the repository (pip builds in place), optionally patch it, install it."""
    project = root / f"src-{name}"
    shutil.copytree(source, project, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    if patch is not None:
        patch(project)
    return pip_install(project, root / f"site-{name}")


@pytest.fixture(scope="module")
def toy_site(tmp_path_factory) -> Path:
    return install_copy(EXAMPLE, tmp_path_factory.mktemp("toy"), "toy")


@pytest.fixture(scope="module")
def toy_checkpoint(tmp_path_factory) -> Path:
    return write_toy_checkpoint(tmp_path_factory.mktemp("toyckpt") / "toy-tiny")


def test_the_example_is_complete():
    for rel in ("pyproject.toml", "README.md", "src/lollm_toy/__init__.py", "src/lollm_toy/plugin.py",
                "src/lollm_toy/modeling.py"):
        assert (EXAMPLE / rel).is_file(), rel
    assert '[project.entry-points."lollm.families"]' in (EXAMPLE / "pyproject.toml").read_text()


def test_families_lists_the_toy(toy_site):
    done = run_lollm("families", "--json", sites=(toy_site,))
    assert done.returncode == 0, done.stderr
    toy = [f for f in json.loads(done.stdout)["families"] if f["family"] == "lollm_toy"]
    assert toy and toy[0]["distribution"] == "lollm-toy" and toy[0]["model_types"] == ["lollm_toy"]


def test_the_lessons_checkpoint_script_makes_a_toy_that_runs(toy_site, tmp_path):
    """docs/toy.md's "Run it": make_checkpoint.py writes a folder lollm run takes, with and without the chat template."""
    import subprocess
    import sys

    folder = tmp_path / "toy-checkpoint"
    made = subprocess.run([sys.executable, str(EXAMPLE / "make_checkpoint.py"), str(folder)], capture_output=True,
                          text=True, env=child_env(toy_site), timeout=300)
    assert made.returncode == 0, made.stdout + made.stderr
    for chat in ((), ("--no-chat",)):
        done = run_lollm("run", "-m", str(folder), "-p", "hello", *chat, "--temperature", "0", "-n", "4",
                         sites=(toy_site,))
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stdout + done.stderr
        assert "lollm_toy on cpu" in done.stderr
    again = subprocess.run([sys.executable, str(EXAMPLE / "make_checkpoint.py"), str(folder)], capture_output=True,
                           text=True, env=child_env(toy_site), timeout=300)
    assert again.returncode != 0 and "Traceback" not in again.stderr  # an existing folder is refused


def test_lollm_run_on_the_toy_checkpoint(toy_site, toy_checkpoint):
    done = run_lollm("run", "-m", str(toy_checkpoint), "-p", "hello world", "--no-chat", "--temperature", "0", "-n", "5",
                     sites=(toy_site,))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    stats = re.search(r"\[(\d+) tokens .* stop: (\w+) · lollm_toy on cpu float32\]", done.stderr)
    assert stats, done.stderr
    assert int(stats.group(1)) <= 5

    # what the CLI printed is what the shared loop generates, greedily, in process
    expect = run_python(
        f"""
        import json
        from lollm.generate.loop import generate, stop_token_ids
        from lollm.load.options import LoadOptions
        from lollm.load.pipeline import open_model
        from lollm.generate.sampling import SamplingParams
        loaded = open_model({str(toy_checkpoint)!r}, LoadOptions(device="cpu"))
        tok = loaded.tokenizer
        ck = loaded.checkpoint
        result = generate(loaded.model, tok.encode("hello world"), max_new_tokens=5,
                          sampling=SamplingParams(temperature=0.0), tokenizer=tok,
                          stop_ids=stop_token_ids(ck.generation_config, ck.config, tok))
        print(json.dumps({{"text": result.text, "n": len(result.new_ids), "stop": result.stop_reason}}))
        """,
        toy_site,
    )
    assert expect.returncode == 0, expect.stderr
    want = json.loads(expect.stdout.strip().splitlines()[-1])
    assert done.stdout == want["text"] + "\n"
    assert int(stats.group(1)) == want["n"] and stats.group(2) == want["stop"]


CONFORMANCE_TEST = '''
from pathlib import Path

import pytest

from lollm.testing.conformance import FamilyConformance


class TestToyConformance(FamilyConformance):
    reference_available = False
    # nothing of the toy stays packed: its float32 linears round a row differently beside other rows
    batch_invariance_weights = "float"
    batch_invariance_bound = 1e-4

    @pytest.fixture
    def family_name(self):
        return "lollm_toy"

    @pytest.fixture
    def checkpoint_dir(self):
        return Path({checkpoint!r})
'''


def run_conformance(site: Path, checkpoint: Path, workdir: Path):
    workdir.mkdir()
    (workdir / "test_toy_conformance.py").write_text(CONFORMANCE_TEST.format(checkpoint=str(checkpoint)))
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "test_toy_conformance.py"],
        capture_output=True, text=True, cwd=workdir, env=child_env(site), timeout=600,
    )


def conformance_tests() -> list[str]:
    from lollm.testing.conformance import FamilyConformance

    return [name for name in dir(FamilyConformance) if name.startswith("test_")]


def test_the_conformance_kit_passes_on_the_toy(toy_site, toy_checkpoint, tmp_path):
    done = run_conformance(toy_site, toy_checkpoint, tmp_path / "kit")
    summary = done.stdout.strip().splitlines()[-1]
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    total = len(conformance_tests())
    # the tests against transformers are skipped (the toy has no reference), and so is the vision check
    # (the toy reads no images); each says why
    from lollm.testing.conformance import REFERENCE_TESTS
    from lollm.testing.vision_checks import VISION_TESTS

    skipped = len(REFERENCE_TESTS) + len(VISION_TESTS)
    assert f"{total - skipped} passed, {skipped} skipped" in summary, done.stdout[-3000:]
    assert done.stdout.count("reference_available = False") == len(REFERENCE_TESTS), done.stdout[-3000:]
    assert "declares no vision (Capabilities.vision is False)" in done.stdout, done.stdout[-3000:]


def break_the_toy(project: Path) -> None:
    """Two bugs a family author could make: positions restart at 0 in decode, and one hidden state too many."""
    path = project / "src" / "lollm_toy" / "modeling.py"
    text = path.read_text()
    before = text
    text = text.replace("positions = token_positions(start, T, input_ids.device)",
                        "positions = token_positions(0, T, input_ids.device)")
    text = text.replace("if hidden_states is not None and i < self.num_layers - 1:", "if hidden_states is not None:")
    assert text != before
    path.write_text(text)


def test_the_conformance_kit_catches_a_broken_family(tmp_path, toy_checkpoint):
    site = install_copy(EXAMPLE, tmp_path, "broken-toy", patch=break_the_toy)
    done = run_conformance(site, toy_checkpoint, tmp_path / "kit")
    assert done.returncode == 1, done.stdout[-3000:]
    failed = set(re.findall(r"FAILED \S+::TestToyConformance::(\w+)", done.stdout))
    assert {"test_forward_shapes_logits_to_keep_and_hidden_states", "test_prefill_all_equals_prefill_then_decode"} <= failed, done.stdout[-3000:]
    assert "test_missing_tensor_raises_naming_it" not in failed
