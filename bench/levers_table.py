"""docs/gpu.md's table of issue 54's three decisions, made by the code: for every GPU preset on a T4, an RTX 3090 and an
RTX 4090 (hardware.PROFILES), what resolve decides for the importance-sampling correction, unsloth's decode CUDA graphs
(as the preset runs, and with model.fast_inference=false) and vLLM's KV-cache dtype, what an fp8 KV cache buys in the
memory plan, and which of them ran on that card. tests/test_levers.py checks that docs/gpu.md shows this table.

    python -m bench.levers_table            # print it
    python -m bench.levers_table --write    # put it into docs/gpu.md between the markers
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "gpu.md"
BEGIN = "<!-- levers table: python -m bench.levers_table --write -->"
END = "<!-- end of levers table -->"
CARDS = ("t4", "rtx3090", "rtx4090")
# (preset, card) -> what ran there with these decisions, with its record; nothing yet (no card was lent for issue 54)
RAN: dict[tuple[str, str], str] = {}


def _fp8_buys(preset: str, card: str) -> str:
    """The plan's KV cache in sequences of model.max_seq_length tokens, and unsloth_zoo's max_model_len, at 16-bit ->
    fp8, on the card with FlashInfer on (an nvcc of torch's CUDA major there): from sm80 vLLM serves an fp8 KV cache
    through FlashInfer, and with FlashInfer off only on sm90/sm100 (resolve.fp8_kv_refusal)."""
    import dataclasses

    from lowvram_grpo.settings.config import load_config
    from lowvram_grpo.core.errors import PlanError, ResolveError
    from lowvram_grpo.settings.hardware import PROFILES
    from lowvram_grpo.settings.memory_terms import estimate
    from lowvram_grpo.settings.resolve import resolve

    out = []
    hardware = dataclasses.replace(PROFILES[card], name="present", nvcc_cuda=(13, 0), torch_cuda="13.0")
    for kv in ("auto", "fp8"):
        try:
            config = load_config(preset, [f"model.kv_cache_dtype={kv}"])
            r = resolve(config, hardware)
            if kv == "auto" and r.kv_cache_dtype == "fp8":
                r = resolve(load_config(preset, [f"model.kv_cache_dtype={r.dtype}"]), hardware)
            plan = estimate(r, r.vram_gib)
        except ResolveError as exc:
            return "-" if kv == "fp8" and "compute capability" in str(exc) else f"refused: {str(exc).split(':')[0]}"
        except PlanError:
            return "no plan (model shape unknown)"
        if plan.kv_cache_bytes is None:
            return "-"
        per_sequence = plan.kv_largest_bytes // plan.kv_sequences
        out.append((max(plan.kv_cache_bytes, 0) // per_sequence, plan.vllm_max_model_len))
    (seq16, len16), (seq8, len8) = out
    tokens = load_config(preset).model.max_seq_length
    return f"{seq16} -> {seq8} sequences of {tokens} tokens; max_model_len {len16} -> {len8}"


def _graphs(r, model_type) -> str:
    if r.decode_graphs:
        return f"on ({model_type})"
    if r.generation != "transformers":
        return "off (vLLM samples)"
    return f"off ({model_type or 'model type unknown'}: not in unsloth's set)"


def _kv_why(reason: str) -> str:
    if reason.startswith("auto -> fp8"):
        return "plan short of KV room at 16-bit"
    if "fp8 KV needs sm80+" in reason:
        return "fp8 needs sm80+"
    if "fp8 KV has no attention backend" in reason:
        return "fp8: no attention backend here with FlashInfer off"
    if "holds the rollout and evaluation batches" in reason:
        return "16-bit holds the batches"
    return reason


def rows() -> list[list[str]]:
    from lowvram_grpo.settings.config import list_presets, load_config
    from lowvram_grpo.core.errors import ResolveError
    from lowvram_grpo.settings.hardware import PROFILES
    from lowvram_grpo.settings.resolve import model_type_of, resolve

    out = []
    for preset in list_presets():
        config = load_config(preset)
        if not config.requires_cuda:
            continue
        for card in CARDS:
            try:
                r = resolve(config, PROFILES[card])
                plain = resolve(load_config(preset, ["model.fast_inference=false"]), PROFILES[card])
            except ResolveError as exc:
                out.append([f"`{preset}`", card, f"refused: {exc}", "", "", "", "", "", ""])
                continue
            is_text = f"on ({r.is_mode})" if r.is_correction else "off"
            graphs = _graphs(r, model_type_of(config.model.name))
            graphs_plain = _graphs(plain, model_type_of(config.model.name))
            kv = f"{r.kv_cache_dtype or '-'} ({_kv_why(r.kv_cache_reason)})"
            out.append([f"`{preset}`", card, r.generation, is_text, graphs, graphs_plain, kv, _fp8_buys(preset, card),
                        RAN.get((preset, card), "not run on this card")])
    return out


def table() -> str:
    header = ["preset", "card", "generation", "IS correction", "decode graphs", "decode graphs, fast_inference=false",
              "KV cache (auto)", "fp8 KV buys (plan: 16-bit -> fp8, FlashInfer on)", "ran"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows()]
    return "\n".join(lines) + "\n"


def write(doc: Path = DOC) -> None:
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"error: {doc} lacks the markers {BEGIN!r} ... {END!r}: add them where the table goes")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(head + BEGIN + "\n" + table() + END + tail)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write the table into {DOC.relative_to(REPO)}")
    args = parser.parse_args(argv)
    if args.write:
        write()
    else:
        sys.stdout.write(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
