"""The Colab-style notebook runs top to bottom on CPU (acceptance).

nbclient executes notebooks/grpo_colab.ipynb in a real IPython kernel of this interpreter. The full run
uses the `tiny` preset (with 2 priming steps, so the primed column shows too) through the notebook's
environment overrides: the CPU default, smollm2_cpu, took 881 s for the notebook even shortened to
4 priming + 2 GRPO steps and 4 held-out questions on this 2-core machine under load, far past CI's
budget (the tiny run takes about 10 s). That the notebook picks smollm2_cpu on a CPU by itself is
checked by running its cells up to the parameter cell without the override.
Any cell that raises fails the test (nbclient's CellExecutionError, nothing caught). The executed
copy lives in memory only; the repository's notebook is not rewritten."""
import nbclient  # requirements-cpu.txt: a missing one fails here, it is not skipped
import nbclient.exceptions
import nbformat
import pytest

from conftest import REPO

pytestmark = pytest.mark.slow  # pytest.ini: the fast tier is -m "not slow"

NOTEBOOK = REPO / "notebooks" / "grpo_colab.ipynb"

# CI's run: the tiny model, 2 priming steps then 3 GRPO steps (seconds).
CI_SETTINGS = {
    "LOWVRAM_GRPO_NOTEBOOK_PRESET": "tiny",
    "LOWVRAM_GRPO_NOTEBOOK_STEPS": "3",
    "LOWVRAM_GRPO_NOTEBOOK_SET": "prime.steps=2",
}


@pytest.fixture(scope="module")
def kernel_here(tmp_path_factory):
    """A `python3` kernel spec that runs this very interpreter, found before any other on JUPYTER_PATH."""
    from ipykernel.kernelspec import install

    prefix = tmp_path_factory.mktemp("jupyter")
    install(prefix=str(prefix), kernel_name="python3")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_PATH", str(prefix / "share" / "jupyter"))
        yield "python3"


@pytest.fixture(scope="module")
def executed(kernel_here, tmp_path_factory):
    out = tmp_path_factory.mktemp("notebook") / "run"
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    with pytest.MonkeyPatch.context() as mp:  # the kernel inherits this environment
        for key, value in CI_SETTINGS.items():
            mp.setenv(key, value)
        mp.setenv("LOWVRAM_GRPO_NOTEBOOK_OUTPUT", str(out))
        execute(notebook, kernel_here)
    return notebook, out


def execute(notebook, kernel_name: str) -> None:
    client = nbclient.NotebookClient(notebook, kernel_name=kernel_name, timeout=900,
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()  # raises CellExecutionError on the first failing cell


def outputs(notebook):
    for cell in notebook.cells:
        if cell.cell_type == "code":
            yield from cell.outputs


def text_of(notebook) -> str:
    parts = []
    for output in outputs(notebook):
        if output.output_type == "stream":
            parts.append(output.text)
        elif output.output_type in ("display_data", "execute_result"):
            parts.append(output.data.get("text/markdown", "") + output.data.get("text/plain", ""))
    return "\n".join(parts)


def test_notebook_runs_top_to_bottom_on_cpu(executed):
    notebook, out = executed
    code_cells = [c for c in notebook.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code_cells), "a code cell did not run"
    assert not [o for o in outputs(notebook) if o.output_type == "error"]
    text = text_of(notebook)
    assert "preset tiny on CPU" in text and "2 priming steps, 3 GRPO steps" in text
    assert "memory plan: builtin:tiny" in text and "needs a card of at least" in text  # no card here: the smallest
    assert "nothing to install" in text  # the install cell is a no-op where the packages are present
    assert "ready: the CPU path is ready" in text  # the doctor cell: the machine's default run can start
    assert "export skipped" in text  # the export cell says why it does nothing on CPU
    assert "12 | error: " in text  # the tools cell: the calculator answers arithmetic, refuses code as text
    assert "parsed: calculator(**{'expression': '6 * 7'}) -> 42" in text  # a call in the model's format, parsed back
    assert (out / "grpo_saved_lora" / "adapter_model.safetensors").is_file()


def test_notebook_shows_the_before_after_table(executed):
    notebook, _ = executed
    tables = [o.data["text/markdown"] for o in outputs(notebook)
              if o.output_type == "display_data" and "text/markdown" in o.data
              and "| held-out metric |" in o.data["text/markdown"]]
    assert tables and "| before (base) | primed | after (GRPO) | change |" in tables[0]
    for metric in ("reward_mean", "accuracy_strict", "accuracy_lenient", "format_rate", "mean_completion_tokens"):
        assert f"| {metric} |" in tables[0]


def test_notebook_shows_the_plots(executed):
    notebook, out = executed
    images = [o for o in outputs(notebook) if o.output_type == "display_data" and "image/png" in o.data]
    assert len(images) == 5  # reward, KL (tiny has beta > 0), completion length, clipped ratio, loss
    assert (out / "report.md").is_file() and (out / "reward.png").is_file()


def test_without_overrides_the_notebook_picks_the_cpu_default(kernel_here, tmp_path):
    """The parameter cell's own choice on this machine (no CUDA): smollm2_cpu. Runs the cells up to it only."""
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    last = next(i for i, c in enumerate(notebook.cells)
                if "LOWVRAM_GRPO_NOTEBOOK_PRESET" in c.source and c.cell_type == "code")
    notebook.cells = notebook.cells[:last + 1]
    with pytest.MonkeyPatch.context() as mp:
        for key in (*CI_SETTINGS, "LOWVRAM_GRPO_NOTEBOOK_OUTPUT"):
            mp.delenv(key, raising=False)
        execute(notebook, kernel_here)
    from lowvram_grpo.settings.config import load_config

    default = load_config("smollm2_cpu")
    text = text_of(notebook)
    assert f"preset smollm2_cpu on CPU: {default.model.name}" in text
    assert f"{default.prime.steps} priming steps, {default.train.max_steps} GRPO steps" in text


def test_the_repository_notebook_is_stored_without_outputs():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    assert all(not c.get("outputs") and not c.get("execution_count") for c in notebook.cells if c.cell_type == "code")


# What a machine with an NVIDIA card shows when torch cannot use it (issue 31 §3.4's Colab case: the notebook
# installs torch 2.13 built for CUDA 13, the driver is older): nvidia-smi answers, torch sees no CUDA device.
# A stand-in for the driver's own tool, on PATH: the GPU-only reading the doctor takes when NVML is not there.
FAKE_NVIDIA_SMI = """#!/bin/sh
case "$1" in
  --query-gpu=*) echo "Tesla T4, 550.54.15" ;;
  *) echo "| NVIDIA-SMI 550.54.15      Driver Version: 550.54.15      CUDA Version: 12.4 |" ;;
esac
"""


def test_on_a_gpu_machine_torch_cannot_use_the_notebook_stops_at_the_doctor(kernel_here, tmp_path):
    """The notebook chooses the GPU preset on a machine with an NVIDIA card even when torch sees none, the doctor
    blocks it with its line and fix, and the doctor's cell raises: no later cell runs, nothing is trained in its
    place (before: the doctor's cell printed a line and went on, and the parameter cell picked smollm2_cpu)."""
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "nvidia-smi").write_text(FAKE_NVIDIA_SMI)
    (tools / "nvidia-smi").chmod(0o755)
    out = tmp_path / "run"
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    # The driver answers from the cell after the install cell on: the state after installing and restarting. Seen
    # by the install cell, it would install requirements.txt into this very interpreter (that cell is tested with
    # pip's calls recorded: tests/test_gpu_path.py).
    install = next(i for i, c in enumerate(notebook.cells) if c.cell_type == "code" and "install_plan(" in c.source)
    notebook.cells.insert(install + 1, nbformat.v4.new_code_cell(
        f"import os\nos.environ['PATH'] = {str(tools)!r} + os.pathsep + os.environ['PATH']"))
    doctor_cell = next(i for i, c in enumerate(notebook.cells)
                       if c.cell_type == "code" and "doctor(CHECKED)" in c.source)
    with pytest.MonkeyPatch.context() as mp:
        for key in CI_SETTINGS:
            mp.delenv(key, raising=False)
        mp.setenv("LOWVRAM_GRPO_NOTEBOOK_OUTPUT", str(out))
        with pytest.raises(nbclient.exceptions.CellExecutionError) as stopped:
            execute(notebook, kernel_here)
    assert stopped.value.ename == "NotReady" and "stops llama8b_4bit on this machine" in stopped.value.evalue
    text = text_of(notebook)
    assert "preset llama8b_4bit on CPU" in text and "preset smollm2_cpu on" not in text  # the GPU preset,
                                                                                         # not the CPU one
    assert "BLOCK" in text and "Tesla T4" in text  # the doctor's blocker, with its fix:
                                                   # the set for this CUDA 12.4 driver
    assert "then pip install -r requirements-cuda12.txt" in text and "update the NVIDIA driver" not in text
    ran = [i for i, c in enumerate(notebook.cells) if c.cell_type == "code" and c.get("execution_count")]
    assert max(ran) == doctor_cell, ran  # nothing after the doctor ran
    assert not out.exists()


def _cell(notebook, marker: str) -> str:
    (source,) = [c.source for c in notebook.cells if c.cell_type == "code" and marker in c.source]
    return source


def test_the_resume_cell_continues_a_cut_run_to_its_end_and_no_further(tmp_path, monkeypatch):
    """The resume cell as a user runs it in a new session: a tiny run cut after its last GRPO step (while its adapter
    was measured: summary still 'training', no report) ends complete with steps == max_steps."""
    import json

    from conftest import run_cli

    out = tmp_path / "cut"
    proc = run_cli("--preset", "tiny", "--max-steps", "2", "--set", "data.eval_size=4", "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    (out / "summary.json").write_text(json.dumps({**summary, "status": "training", "after": None}))
    (out / "report.md").unlink()
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    monkeypatch.setenv("LOWVRAM_GRPO_NOTEBOOK_RESUME", str(out))
    namespace = {"os": __import__("os")}
    exec(compile(_cell(notebook, "RESUME_FROM"), "resume-cell", "exec"), namespace)  # the cell's own code
    done = json.loads((out / "summary.json").read_text())
    assert done["status"] == "complete" and done["steps"] == 2 and done["after"] is not None
    assert (out / "report.md").is_file()


def test_the_t4_path_is_what_the_parameter_cell_applies_and_it_is_shorter_than_the_recipe():
    """The T4 settings of the parameter cell load with the notebook's preset and shorten it (docs/gpu.md's estimate)."""
    import ast

    from lowvram_grpo.settings.config import load_config

    source = _cell(nbformat.read(NOTEBOOK, as_version=4), "T4_SETTINGS = ")
    (assign,) = [n for n in ast.parse(source).body if isinstance(n, ast.Assign) and n.targets[0].id == "T4_SETTINGS"]
    t4 = load_config("llama8b_4bit", ast.literal_eval(assign.value))
    full = load_config("llama8b_4bit")
    assert t4.train.max_steps < full.train.max_steps and t4.data.eval_size < full.data.eval_size
    assert t4.train.save_steps <= 10  # a cut session loses at most 10 steps
    docs = (REPO / "docs" / "gpu.md").read_text()
    assert " ".join(ast.literal_eval(assign.value)) in docs  # the estimate in docs/gpu.md is for these settings


def _cells_up_to(notebook, marker: str):
    last = next(i for i, c in enumerate(notebook.cells) if c.cell_type == "code" and marker in c.source)
    notebook.cells = notebook.cells[:last + 1]
    return notebook


def test_the_doctor_cell_checks_the_settings_the_run_gets(kernel_here, tmp_path):
    """A preset that asks for vLLM (`fast_inference: true`, as llama8b_4bit does) cannot start on this CPU: the doctor
    blocks it. With the setting its blocker advises (model.fast_inference=false) in the notebook's settings the doctor
    cell passes, so it checked those settings and not the preset's defaults; without them the cell stops (before:
    the cell checked `--preset` alone and stopped either way)."""
    preset = tmp_path / "tiny_with_vllm.yaml"
    preset.write_text((REPO / "presets" / "tiny.yaml").read_text().replace("fast_inference: false",
                                                                           "fast_inference: true"))
    runs = {}
    for name, settings in (("applied", "model.fast_inference=false"), ("without", "")):
        notebook = _cells_up_to(nbformat.read(NOTEBOOK, as_version=4), "doctor(")
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("LOWVRAM_GRPO_NOTEBOOK_PRESET", str(preset))
            mp.setenv("LOWVRAM_GRPO_NOTEBOOK_SET", settings)
            mp.delenv("LOWVRAM_GRPO_NOTEBOOK_STEPS", raising=False)
            mp.setenv("LOWVRAM_GRPO_NOTEBOOK_OUTPUT", str(tmp_path / name))
            try:
                execute(notebook, kernel_here)
                runs[name] = None
            except nbclient.exceptions.CellExecutionError as exc:
                runs[name] = exc
        runs[name, "text"] = text_of(notebook)
    assert runs["applied"] is None, runs["applied"]
    assert (f"ready: the CPU path is ready: python -m lowvram_grpo.run --preset {preset} "
            "--set model.fast_inference=false"
            in runs["applied", "text"])
    assert runs["without"].ename == "NotReady" and "model.fast_inference uses vLLM" in runs["without", "text"]


def test_the_t4_settings_merge_with_the_users(monkeypatch):
    """The parameter cell on a T4 (torch's CUDA readings given as a T4's: no card here) with settings of the user's:
    the T4 shortening stays for the keys the user did not set, the user's value wins for the keys both set (before:
    any user setting dropped the T4 shortening, and 250 steps with 500 held-out questions ran). Without vLLM in the
    install (this machine has no GPU set), the cell adds model.fast_inference=false and says so."""
    from pathlib import Path
    from types import SimpleNamespace

    import torch

    source = _cell(nbformat.read(NOTEBOOK, as_version=4), "T4_SETTINGS = ")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: SimpleNamespace(name="Tesla T4", major=7, minor=5, total_memory=15 * 2 ** 30))
    monkeypatch.setenv("LOWVRAM_GRPO_NOTEBOOK_PRESET", "llama8b_4bit")
    monkeypatch.setenv("LOWVRAM_GRPO_NOTEBOOK_OUTPUT", "unused")
    monkeypatch.delenv("LOWVRAM_GRPO_NOTEBOOK_STEPS", raising=False)
    configs = {}
    for mine in ("", "train.max_steps=30 train.learning_rate=1e-5"):
        monkeypatch.setenv("LOWVRAM_GRPO_NOTEBOOK_SET", mine)
        namespace = {"Path": Path}
        exec(compile(source, "parameter-cell", "exec"), namespace)  # the cell's own code
        configs[mine] = namespace["config"]
        assert "model.fast_inference=false" in namespace["SETTINGS"] and not namespace["config"].model.fast_inference
    shortened, merged = configs[""], configs["train.max_steps=30 train.learning_rate=1e-5"]
    assert (shortened.train.max_steps, shortened.train.save_steps, shortened.data.eval_size) == (100, 10, 100)
    assert (merged.train.max_steps, merged.train.save_steps, merged.data.eval_size) == (30, 10, 100)
    assert merged.train.learning_rate == 1e-5
