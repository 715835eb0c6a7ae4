"""Model shapes from the model itself (lowvram_grpo.settings.model_shapes): each family's parameters counted as
transformers builds the model, its KV cache and linear-attention state as transformers' own cache holds them,
config.json read from a local folder or the local hub cache (offline: the fallback table, or one line naming the file),
and the presets of today's notebooks planned offline on the cards their headers name."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml

from conftest import REPO
from lowvram_grpo.settings.model_shapes import KNOWN_SHAPES, SHAPE_SOURCES, model_shape, shape_from_config

NEW_PRESETS = ["qwen3_4b_4bit", "qwen3_5_0_8b", "gemma3_1b", "llama3_2_3b_4bit"]
CARDS = ["t4", "rtx3090", "rtx4090"]


def _tiny_configs():
    """(family, transformers config, model class) of a few-layer model of each family, from transformers' own
    classes."""
    import transformers as T

    common = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
    text = dict(common, num_hidden_layers=8, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=8, linear_value_head_dim=16, linear_conv_kernel_dim=4)
    vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                  num_position_embeddings=16, patch_size=4)
    return [
        ("llama", T.LlamaConfig(**common, num_hidden_layers=3), T.LlamaForCausalLM),
        ("qwen3", T.Qwen3Config(**common, num_hidden_layers=3, head_dim=32, tie_word_embeddings=True),
         T.Qwen3ForCausalLM),
        ("gemma3", T.Gemma3TextConfig(**dict(common, num_key_value_heads=1), num_hidden_layers=7, head_dim=32,
                                      sliding_window=16), T.Gemma3ForCausalLM),
        ("qwen3_5", T.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True),
         T.Qwen3_5ForConditionalGeneration),
        ("qwen3_5", T.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False),
         T.Qwen3_5ForConditionalGeneration),
        ("gpt_oss", T.GptOssConfig(**common, num_hidden_layers=4, head_dim=16, num_local_experts=4,
                                   num_experts_per_tok=2, sliding_window=8), T.GptOssForCausalLM),
    ]


@pytest.mark.parametrize("index", range(6))
def test_each_familys_parameters_are_counted_as_transformers_builds_the_model(index):
    """Qwen3's q/k norms, Gemma 3's four norms a layer and sliding layers, Qwen3.5's Gated DeltaNet layers, gated
    q_proj and vision tower, gpt-oss's experts, sinks and biases: the shape's count is the model's, tied or not."""
    from accelerate import init_empty_weights

    family, config, cls = _tiny_configs()[index]
    with init_empty_weights():
        model = cls(config)
    model.tie_weights()
    shape = shape_from_config(config.to_dict(), "tiny")
    assert shape.family == family
    assert shape.params == sum(p.numel() for p in model.parameters())
    linear = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if type(m).__name__ == "Linear"
              and ".layers." in name and "visual" not in name}
    assert set(shape.linear_dims()) == linear  # the module names LoRA's target_modules match


@pytest.mark.parametrize("family", ["gemma3", "qwen3_5"])
def test_the_kv_cache_and_state_are_what_transformers_cache_holds(family):
    """A forward of `tokens` tokens through the tiny model: its cache (K and V of the attention layers, Gemma 3's
    sliding layers at most the window, Qwen3.5's recurrent and convolution state instead of K and V in its Gated
    DeltaNet layers) is the plan's model_shapes.kv_cache_bytes at the model's own element size."""
    import torch

    _, config, cls = next(c for c in _tiny_configs() if c[0] == family)
    torch.manual_seed(0)
    model = cls(config).eval()
    shape = shape_from_config(config.to_dict(), "tiny")
    tokens = 40
    with torch.no_grad():
        out = model(input_ids=torch.randint(0, 300, (1, tokens)), use_cache=True)
    held = 0
    for layer in out.past_key_values.layers:
        for name in ("keys", "values", "conv_states", "recurrent_states"):
            value = getattr(layer, name, None)
            tensors = list(value.values()) if isinstance(value, dict) else [value]
            held += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    if family == "qwen3_5":
        # an fp32 model: its conv state at 4 bytes (the plan: 16-bit, as vLLM serves it), and transformers keeps
        # conv_kernel inputs where vLLM keeps conv_kernel - 1 (what the plan counts); the recurrent state is fp32
        la, linear = shape.linear_attention, shape.count("linear_attention")
        assert linear == 6 and held > shape.kv_cache_bytes(1, tokens, 4) - shape.state_bytes_per_sequence()
        assert held == (shape.kv_cache_bytes(1, tokens, 4) - shape.state_bytes_per_sequence()
                        + linear * la.state_bytes(4) + linear * la.conv_dim * 4)
    else:
        # transformers keeps window - 1 past tokens in a sliding layer; the plan counts the window (with the new token)
        one_token = shape.count("sliding_attention") * 2 * shape.kv_dim * 4
        assert held == shape.kv_cache_bytes(1, tokens, 4) - one_token
        assert shape.kv_cache_bytes(1, tokens, 4) < 2 * shape.layers * shape.kv_dim * tokens * 4  # the window bounds it


def test_the_fallback_table_names_the_source_of_every_number():
    assert set(KNOWN_SHAPES) <= set(SHAPE_SOURCES)
    for key in ("qwen3-4b", "qwen3.5-0.8b", "gemma-3-1b", "gpt-oss-20b", "llama-3.2-3b"):
        shape = KNOWN_SHAPES[key]
        for number in (shape.hidden, shape.layers, shape.intermediate, shape.vocab):
            assert str(number) in SHAPE_SOURCES[key], (key, number)


# --------------------------------------------------------------------------- where config.json comes from

def _cli(args_list, env, tmp_path):
    """lowvram_grpo.run.cli.main for each argument list, in one fresh process with `env` (HF_HUB_* are read when
    huggingface_hub is imported): [(rc, stdout, stderr)]."""
    code = ("import contextlib, io, json, sys\nfrom lowvram_grpo.run.cli import main\nout = []\n"
            f"for args in {args_list!r}:\n"
            "    o, e = io.StringIO(), io.StringIO()\n"
            "    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):\n"
            "        try:\n            rc = main(args)\n        except SystemExit as exc:\n            rc = exc.code\n"
            "    out.append((rc, o.getvalue(), e.getvalue()))\n"
            "print(json.dumps(out))\n")
    import os

    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO), **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _offline(tmp_path):
    return {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub-cache")}


def _plan_total(stdout: str) -> float:
    return float(re.search(r"^  total\s+([\d.]+)", stdout, re.MULTILINE).group(1))


def test_every_new_preset_prints_its_settings_and_plan_offline_on_each_card(tmp_path):
    """`--preset P --dry-run --gpu CARD` with the hub offline and nothing cached: the settings, then the plan from
    the preset's shape in the fallback table, its family's line and whether vLLM serves it; and the card table in
    the preset's header is that plan's."""
    runs = [(p, c) for p in NEW_PRESETS for c in CARDS]
    results = _cli([["--preset", p, "--dry-run", "--gpu", c] for p, c in runs], _offline(tmp_path), tmp_path)
    for (preset, card), (rc, out, err) in zip(runs, results):
        assert rc == 0, (preset, card, err)
        assert f"preset: {preset}" in out  # the settings
        assert "model.name" not in err and "error" not in err.lower(), err
        assert "shape from: lowvram_grpo.settings.model_shapes.KNOWN_SHAPES" in out and "HF_HUB_OFFLINE is set" in out
        served = (preset, card) != ("gemma3_1b", "t4")  # issue 65: no float16 vLLM for Gemma 3, unsloth's is fp16 there
        assert ("vLLM: serves " in out) is served and "fits a" in out, (preset, card, out[-2000:])
        assert served or "vLLM 0.31 refuses float16 for model type gemma3" in out
        header = (REPO / "presets" / f"{preset}.yaml").read_text()
        row = re.search(rf"^#   {card}\s+([\d.]+)\s+([\d.]+)\s+(yes|NO)$", header, re.MULTILINE)
        assert row, f"{preset}'s header has no {card} row"
        assert float(row.group(2)) == pytest.approx(_plan_total(out), abs=0.051), (preset, card)


def _hub_cache_with(tmp_path, repo: str, config: dict):
    """huggingface_hub's cache layout holding `repo`'s config.json alone (refs/main -> a snapshot)."""
    root = tmp_path / "hub-cache" / f"models--{repo.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    (root / "snapshots" / commit).mkdir(parents=True)
    (root / "snapshots" / commit / "config.json").write_text(json.dumps(config))
    return root / "snapshots" / commit / "config.json"


def _qwen3_4b_config() -> dict:
    import transformers

    s = KNOWN_SHAPES["qwen3-4b"]
    return transformers.Qwen3Config(hidden_size=s.hidden, num_hidden_layers=s.layers, num_attention_heads=s.heads,
                                    num_key_value_heads=s.kv_heads, head_dim=s.head_dim,
                                    intermediate_size=s.intermediate, vocab_size=s.vocab, tie_word_embeddings=True,
                                    max_position_embeddings=s.context).to_dict()


def test_the_plan_reads_config_json_from_the_hub_cache_and_a_local_folder(tmp_path, tiny_model_dir):
    """An id whose config.json is in the local hub cache is planned from that file (offline, no table entry); a
    folder holding only a config.json and a tokenizer is planned from its config.json; both give the table's plan
    for the same numbers."""
    import shutil

    config = _qwen3_4b_config()
    cached = _hub_cache_with(tmp_path, "someorg/Unlisted-4B", config)
    folder = tmp_path / "only-config"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_model_dir / name, folder / name)
    base = ["--preset", "qwen3_4b_4bit", "--dry-run", "--gpu", "t4"]
    (rc1, table, _), (rc2, hub, _), (rc3, local, _) = _cli(
        [base, base + ["--set", "model.name=someorg/Unlisted-4B"], base + ["--set", f"model.name={folder}"]],
        _offline(tmp_path), tmp_path)
    assert rc1 == rc2 == rc3 == 0
    assert f"shape from: config.json in the hub cache ({cached})" in hub
    assert f"shape from: {folder / 'config.json'}" in local
    assert _plan_total(table) == _plan_total(hub) == _plan_total(local)


def test_offline_with_no_cached_copy_is_one_line_naming_the_file(tmp_path):
    """The dry-run says it cannot plan, naming config.json and the cache; a run is refused with one `error:` line
    before anything loads or is written."""
    out_dir = tmp_path / "out"
    (rc1, dry, _), (rc2, run_out, run_err) = _cli(
        [["--preset", "llama8b_4bit", "--dry-run", "--gpu", "t4", "--set", "model.name=someorg/Not-Cached-7B"],
         ["--preset", "tiny", "--set", "model.name=someorg/Not-Cached-7B", "--output-dir", str(out_dir)]],
        _offline(tmp_path), tmp_path)
    assert rc1 == 0 and "GPU memory plan: cannot plan for someorg/Not-Cached-7B: its config.json is not in the " \
                       "local hub cache" in dry and "HF_HUB_OFFLINE is set" in dry
    errors = [line for line in run_err.splitlines() if line.strip()]
    assert rc2 == 2 and len(errors) == 1 and errors[0].startswith(
        "error: model.name someorg/Not-Cached-7B: its config.json is not in the local hub cache"), run_err
    assert not out_dir.exists()


def test_a_folder_without_config_json_is_named(tmp_path):
    from lowvram_grpo.core.errors import PlanError

    with pytest.raises(PlanError, match="without a config.json"):
        model_shape(str(tmp_path))


def test_the_plan_says_what_it_cannot_know_and_where_unsloth_runs_no_vllm(tmp_path):
    """gpt-oss offline: its shape from the table, the expert LoRA it cannot know said as such, and unsloth's refusal
    to share its weights with vLLM (VLLM_UNSUPPORTED_MODEL_TYPES) said with the setting to change."""
    base = ["--preset", "qwen3_4b_4bit", "--dry-run", "--gpu", "rtx4090", "--set", "model.name=unsloth/gpt-oss-20b"]
    (rc1, on, _), (rc2, off, _) = _cli([base, base + ["--set", "model.fast_inference=false"]],
                                       _offline(tmp_path), tmp_path)
    assert rc1 == rc2 == 0
    for out in (on, off):
        assert "KNOWN_SHAPES['gpt-oss-20b']" in out and "not known: which expert modules LoRA adapts" in out
    assert "vLLM: NOT for gpt_oss: unsloth 2026.10.9 lists gpt_oss in VLLM_UNSUPPORTED_MODEL_TYPES" in on
    assert "set model.fast_inference=false" in on
    assert "vLLM: off for gpt_oss" in off and "vLLM KV cache" not in off


def test_online_the_plan_downloads_config_json_alone_then_reads_it_from_the_cache(tmp_path):
    """Online (HF_ENDPOINT: a stand-in for huggingface.co, which these machines cannot reach, answering HEAD and GET
    as the hub does for one file: X-Repo-Commit, ETag, the bytes): the dry-run's plan is made from config.json
    downloaded by huggingface_hub's hf_hub_download into the hub cache, the only file asked for; the next dry-run
    reads it from the cache without asking the hub."""
    import http.server
    import threading

    config = _qwen3_4b_config()
    body = json.dumps(config).encode()
    asked = []

    class Hub(http.server.BaseHTTPRequestHandler):
        def _head(self) -> bool:
            asked.append((self.command, self.path))
            if not self.path.endswith("/someorg/Online-4B/resolve/main/config.json"):
                self.send_response(404)
                self.end_headers()
                return False
            self.send_response(200)
            self.send_header("X-Repo-Commit", "0123456789abcdef0123456789abcdef01234567")
            self.send_header("ETag", '"config-etag"')
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            return True

        def do_HEAD(self):
            self._head()

        def do_GET(self):
            if self._head():
                self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {"HF_ENDPOINT": f"http://127.0.0.1:{server.server_address[1]}",
               "HF_HUB_CACHE": str(tmp_path / "hub-cache"),
               "HF_HUB_OFFLINE": "0"}  # online on purpose, also where the user's shell sets offline
        base = ["--preset", "qwen3_4b_4bit", "--dry-run", "--gpu", "t4"]
        (rc1, table, _), = _cli([base], _offline(tmp_path), tmp_path)
        (rc2, online, _), = _cli([base + ["--set", "model.name=someorg/Online-4B"]], env, tmp_path)
        files = {path for _, path in asked if "/resolve/" in path}
        asked.clear()
        (rc3, cached, _), = _cli([base + ["--set", "model.name=someorg/Online-4B"]], env, tmp_path)
    finally:
        server.shutdown()
    assert rc1 == rc2 == rc3 == 0
    assert "shape from: config.json downloaded from the hub (" in online, re.search("shape from: .*", online).group(0)
    assert files == {"/someorg/Online-4B/resolve/main/config.json"}  # config.json alone
    assert "shape from: config.json in the hub cache (" in cached and not [a for a in asked if "/resolve/" in a[1]]
    assert _plan_total(table) == _plan_total(online) == _plan_total(cached)
