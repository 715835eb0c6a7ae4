"""The engine: vLLM's `LLM` on the base checkpoint with per-request LoRA, the trained adapter synced to it
as a new version (adapter-only), generation for the evaluation and sampling for the rollouts, its
blocking calls watched for a dead process; and the registry that closes the engines a run started
when the run raises."""
from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import psutil

from lowvram_grpo.model import lora_io
from lowvram_grpo.model.handle import AdapterVersions, Completion, LoraRequest, SamplingParams
from lowvram_grpo.model.vllm.processes import (
    allowed_cpus,
    child_pids,
    end_processes,
    engine_pids,
    environ,
    sigint_blocked,
    start_watchdog,
)
from lowvram_grpo.model.vllm.settings import (
    EngineSettings,
    VLLMEngineDied,
    VLLMEngineError,
    engine_kwargs,
    eval_sampling_kwargs,
    rollout_sampling_kwargs,
)


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
    removed_ids: list = field(default_factory=list)
    ids_used: list = field(default_factory=list)   # the vLLM adapter id of every rollout request, in order


class LocalVLLMEngine:
    """vLLM's LLM on the base checkpoint with per-request LoRA; the `GenerationEngine` of handle.py, plus
    `sync` (adapter-only policy update), `rollout` (TRL's rollout_func) and `close`."""

    def __init__(self, settings: EngineSettings, tokenizer):
        """Nothing starts here: `start()` (or `with LocalVLLMEngine(...) as engine:`) starts vLLM."""
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

    def load_lora(self, path: Path) -> LoraRequest:
        """The GenerationEngine call behind handle.load_lora: a request for the saved adapter, by version;
        vLLM reads it from disk when generating (vllm_request), the trained PEFT model is not touched."""
        return self.versions.get(path, lambda name, new_id, path_text, version: LoraRequest(
            name=name, id=new_id, path=path_text, version=version))

    def release_lora(self, request: LoraRequest) -> None:
        """Nothing to free here: vLLM reads the adapter from disk and evicts it itself (max_loras)."""
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
        before = child_pids()
        with environ(env), sigint_blocked():
            from vllm import LLM

            kwargs = engine_kwargs(s)
            try:
                self.llm = LLM(**kwargs)
            except Exception as exc:  # vLLM's own log above names the root cause (its worker's error)
                self.pids = engine_pids(child_pids() - before)
                self.close()
                cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise VLLMEngineError(f"vLLM could not start ({cause[:300]})") from None
            finally:
                self.pids = self.pids or engine_pids(child_pids() - before)
        self._watchdog = start_watchdog(self.pids)
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
        left = end_processes(self.pids, timeout=10.0) if self.pids else []
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
                raise VLLMEngineDied(
                    f"its process {self.dead_pids()[0]} ended during {what} (killed, or out of memory)")
        if "error" in outcome:
            dead = self.dead_pids() if self.pids else []
            if dead and not isinstance(outcome["error"], VLLMEngineDied):
                # vLLM's own process monitor saw the death first (EngineDeadError): name the process, as above
                raise VLLMEngineDied(f"its process {dead[0]} ended during {what} (killed, or out of memory)") \
                    from outcome["error"]
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

    def generate(self, texts: list[str], params: SamplingParams,
                 lora_request: Optional[LoraRequest]) -> list[Completion]:
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
                k, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                repetition_penalty=repetition_penalty, max_tokens=max_tokens, stop_token_ids=stop_token_ids,
                seed=None if seed is None else seed + 1000 * i))
            for i, k in enumerate(n)
        ]
        outputs = self._watched("the rollout", llm.generate, [{"prompt_token_ids": list(p)} for p in prompt_ids],
                                params, lora_request=request, use_tqdm=False)
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


# engines started for runs (closes_engines_on_error)
OPEN_ENGINES: "weakref.WeakSet[LocalVLLMEngine]" = weakref.WeakSet()


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


def closes_engines_on_error(fn):
    """Decorator for pipeline.run: an engine started during the call is closed when the call raises
    (an error, a stop, a KeyboardInterrupt). After a normal return it stays with the handle, which the
    notebook keeps generating with; it is closed at exit."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        before = set(OPEN_ENGINES)
        try:
            return fn(*args, **kwargs)
        except BaseException:
            for engine in list(OPEN_ENGINES):
                if engine not in before:
                    engine.close()
            raise

    return wrapper
