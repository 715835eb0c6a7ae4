"""The user's code of one run, loaded once: its reward functions, its tools and its environment class.

    user = load(plan)                # GRPORun.__init__, before anything heavy: each file imported, each name
                                     # turned into its function, checked; every failure one ConfigError line
    user.reward_functions(warn)      # what TRL and the held-out numbers call (guarded, a fresh count per caller)
    user.tool_functions()            # tools.names, each bounded in time (tools.bounded)
    user.bounded_environment()       # the environment class with its tool methods bounded, or None
    user.prompt_tools()              # what every prompt renders: the tools + the environment's methods

`plan`: a plans.RunPlan or any phase's plan (each carries `rewards`, `tools` and `prompts`). Every phase of a run
(the checks, priming, training, the held-out answers with tools, the measurements) reads the same `UserCode` through
`of(plan)`: the one `load` made for those settings, or a new one for settings no run loaded (the `eval` command, a
test). Pure: imports nothing heavy; the user's files are the only code it runs.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Optional

from lowvram_grpo.core.errors import ConfigError
from lowvram_grpo.task import rewards, tools

# (rewards, tools, chat template arguments) -> their UserCode; the newest few (a run has one, a test suite many)
_LOADED: "OrderedDict[tuple, UserCode]" = OrderedDict()
_KEEP = 8


class UserCode:
    """The callables of one run's settings, looked up once (`load`). `on_error`: rewards.on_error;
    `timeout_seconds`: tools.timeout_seconds; `environment_module`: environment.module."""
    def __init__(self, reward_fns: list[tuple[str, Callable]], tool_fns: list[Callable], environment: Optional[type],
                 on_error: str, timeout_seconds: float, environment_module: Optional[str]):
        self.on_error, self.timeout_seconds, self.environment_module = on_error, timeout_seconds, environment_module
        self.reward_fns = tuple(reward_fns)  # (name in rewards.names, its function:
                                             # built-in, the user's, a RewardModel)
        self.tools = tuple(tool_fns)         # tools.names' functions, checked (tools.selected_tools)
        self.environment = environment       # environment.name's class, checked (tools.environment_class)
        self._prompt_tools: Optional[list[Callable]] = None

    def reward_functions(self, warn=None) -> list[Callable]:
        """The configured rewards in order, each wrapped by rewards.guarded (its own failure count)."""
        return [rewards.guarded(fn, rewards.logged_name(name), self.on_error, warn) for name, fn in self.reward_fns]

    def tool_functions(self) -> list[Callable]:
        """What TRL is handed as `tools`: each function bounded in time, every answer text (tools.bounded)."""
        return [tools.bounded(fn, self.timeout_seconds) for fn in self.tools]

    def bounded_environment(self) -> Optional[type]:
        if self.environment is None:
            return None
        return tools.bounded_environment(self.environment, self.timeout_seconds)

    def build_environment(self, cls: type):
        return tools.build_environment(cls, self.environment_module)

    def prompt_tools(self) -> list[Callable]:
        """The tools a prompt renders (their schemas go into every prompt TRL renders): the bounded tools, then
        the environment's tool methods bound to one probe instance (built once)."""
        if self._prompt_tools is None:
            found = self.tool_functions()
            cls = self.bounded_environment()
            if cls is not None:
                probe = self.build_environment(cls)
                found += [getattr(probe, name) for name, _ in tools.environment_methods(type(probe))]
            self._prompt_tools = found
        return list(self._prompt_tools)


def _reward_fns(reward_plan, chat_template_kwargs: dict) -> list[tuple[str, Callable]]:
    try:
        module = rewards.load_reward_module(reward_plan.module) if reward_plan.module else None
        return [(name, rewards.lookup_reward(name, module, chat_template_kwargs)) for name in reward_plan.names]
    except rewards.RewardError as exc:
        raise ConfigError(str(exc)) from None


def _key(plan) -> tuple:
    return plan.rewards, plan.tools, repr(plan.prompts.chat_template_kwargs)


def load(plan) -> UserCode:
    """Import the user's reward, tool and environment files and turn rewards.names, tools.names and environment.name
    into their callables, checked (ConfigError, one line); kept for these settings (of)."""
    tool_plan = plan.tools
    user = UserCode(_reward_fns(plan.rewards, plan.prompts.template_kwargs), tools.selected_tools(tool_plan),
                    tools.environment_class(tool_plan.environment, tool_plan.environment_module),
                    on_error=plan.rewards.on_error, timeout_seconds=tool_plan.timeout_seconds,
                    environment_module=tool_plan.environment_module)
    key = _key(plan)
    _LOADED.pop(key, None)
    _LOADED[key] = user
    while len(_LOADED) > _KEEP:
        _LOADED.popitem(last=False)
    return user


def of(plan) -> UserCode:
    """The UserCode `load` made for these settings, else a new one."""
    found = _LOADED.get(_key(plan))
    return found if found is not None else load(plan)
