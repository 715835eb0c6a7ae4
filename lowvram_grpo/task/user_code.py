"""The user's code of one run, loaded once: its reward functions, its tools and its environment class.

    user = load(config)              # GRPORun.__init__, before anything heavy: each file imported, each name
                                     # turned into its function, checked; every failure one ConfigError line
    user.reward_functions(warn)      # what TRL and the held-out numbers call (guarded, a fresh count per caller)
    user.tool_functions()            # tools.names, each bounded in time (tools.bounded)
    user.bounded_environment()       # the environment class with its tool methods bounded, or None
    user.prompt_tools()              # what every prompt renders: the tools + the environment's methods

Every phase of a run (the checks, priming, training, the held-out answers with tools, the measurements) reads the
same `UserCode` through `of(config)`: the one `load` made for that config object, or a new one for a config that
no run loaded (the `eval` command, a test). Pure: imports nothing heavy; the user's files are the only code it runs.
"""
from __future__ import annotations

import weakref
from typing import Callable, Optional

from lowvram_grpo.run.errors import ConfigError
from lowvram_grpo.task import rewards, tools

_LOADED: dict[int, "UserCode"] = {}  # id(config) -> its UserCode, dropped when the config is


class UserCode:
    """The callables of one config, looked up once (`load`)."""
    def __init__(self, config, reward_fns: list[tuple[str, Callable]], tool_fns: list[Callable],
                 environment: Optional[type]):
        self.rewards_config, self.tools_config, self.environment_config = config.rewards, config.tools, config.environment
        self.reward_fns = tuple(reward_fns)  # (name in rewards.names, its function: built-in, the user's, a RewardModel)
        self.tools = tuple(tool_fns)         # tools.names' functions, checked (tools.selected_tools)
        self.environment = environment       # environment.name's class, checked (tools.environment_class)
        self._prompt_tools: Optional[list[Callable]] = None

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools) or self.environment is not None

    def reward_functions(self, warn=None) -> list[Callable]:
        """The configured rewards in order, each wrapped by rewards.guarded (its own failure count)."""
        on_error = self.rewards_config.on_error
        return [rewards.guarded(fn, rewards.logged_name(name), on_error, warn) for name, fn in self.reward_fns]

    def tool_functions(self) -> list[Callable]:
        """What TRL is handed as `tools`: each function bounded in time, every answer text (tools.bounded)."""
        return [tools.bounded(fn, self.tools_config.timeout_seconds) for fn in self.tools]

    def bounded_environment(self) -> Optional[type]:
        if self.environment is None:
            return None
        return tools.bounded_environment(self.environment, self.tools_config.timeout_seconds)

    def build_environment(self, cls: type):
        return tools.build_environment(cls, self.environment_config.module)

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


def _reward_fns(rewards_config, chat_template_kwargs=None) -> list[tuple[str, Callable]]:
    try:
        module = rewards.load_reward_module(rewards_config.module) if rewards_config.module else None
        return [(name, rewards.lookup_reward(name, module, chat_template_kwargs)) for name in rewards_config.names]
    except rewards.RewardError as exc:
        raise ConfigError(str(exc)) from None


def load(config) -> UserCode:
    """Import the user's reward, tool and environment files and turn rewards.names, tools.names and environment.name
    into their callables, checked (ConfigError, one line); kept for `config` (of)."""
    user = UserCode(config, _reward_fns(config.rewards, config.data.chat_template_kwargs), tools.selected_tools(config.tools),
                    tools.environment_class(config.environment))
    key = id(config)
    _LOADED[key] = user
    weakref.finalize(config, _LOADED.pop, key, None)
    return user


def of(config) -> UserCode:
    """The UserCode `load` made for this config object, else a new one."""
    found = _LOADED.get(id(config))
    return found if found is not None else load(config)
