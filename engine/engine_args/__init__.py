"""Flat engine arguments (the command-line flags and `LLM(...)` keywords) -> `EngineConfig`.

`EngineArgs` is made from the configs' settings (`engine.config.setting`): one field per
setting, under its flat name, with the config field's type, default and help, so that each
is stated once, in `engine.config`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

from engine.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    PolicyOptionValue,
    SchedulerConfig,
    StructuredOutputConfig,
    TraceConfig,
    policy_option_value,
)
from engine.engine_args.flags import (
    Setting,
    add_flags,
    config_of,
    flags_of,
    flat_settings,
    settings_of,
)
from engine.executor.sim_profiles import get_sim_profile
from engine.model.directory import load_arch
from engine.model.tokenizer import tokenizer_dir
from engine.scheduler.options import option_items_to_dict
from engine.scheduler.policy_registry import (
    POLICIES,
    check_policy_options,
    policy_options_help,
)

TRACE_PATH_VARIABLES = ("CONTINUUM_TRACE_PATH", "VLLM_SCHED_TRACE_PATH")


@dataclass(frozen=True)
@flat_settings(ModelConfig, CacheConfig, SchedulerConfig, TraceConfig, StructuredOutputConfig,
               EngineConfig)
class EngineArgs:
    """Every engine setting as one flat, frozen record (`flat_settings`: the fields are the
    configs' settings). `max_model_len` is the model's (None: its own context length, which
    `to_engine_config` gives the scheduler too)."""

    # KEY=VALUE items (as the flags give them) or a mapping of typed values (as a config
    # file gives them): SchedulerConfig's dict once checked.
    policy_options: tuple[str, ...] | Mapping[str, PolicyOptionValue] = ()

    def to_engine_config(self, environ: Mapping[str, str] = os.environ) -> EngineConfig:
        """The validated config; ValueError naming the bad field (or a model without tokenizer
        files and no `tokenizer`). Without `trace_path`, the first of `TRACE_PATH_VARIABLES`
        set (non-empty) in `environ` enables tracing."""
        values = {spec.name: getattr(self, spec.name) for spec in fields(self)}
        if self.max_model_len is None:
            values["max_model_len"] = load_arch(self.model).max_position_embeddings
        tokenizer_dir(self.model, self.tokenizer)  # before any process starts
        if self.sim_profile is not None:
            get_sim_profile(self.sim_profile)
        values["policy_options"] = self._checked_policy_options()
        values["trace_path"] = self._trace_path(environ)
        config = config_of(
            EngineConfig, values, model=config_of(ModelConfig, values),
            cache=config_of(CacheConfig, values),
            scheduler=config_of(SchedulerConfig, values),
            trace=config_of(TraceConfig, values),
            structured_output=config_of(StructuredOutputConfig, values))
        assert isinstance(config, EngineConfig)
        return config

    def _checked_policy_options(self) -> dict[str, PolicyOptionValue]:
        options = self._policy_options()
        check_policy_options(self.scheduling_policy, options)
        return options

    def _policy_options(self) -> dict[str, PolicyOptionValue]:
        if isinstance(self.policy_options, Mapping):
            return {str(key): policy_option_value(key, value)
                    for key, value in self.policy_options.items()}
        if isinstance(self.policy_options, str):
            raise ValueError("policy_options must be KEY=VALUE items or a mapping, not a string")
        return option_items_to_dict(self.policy_options)

    def _trace_path(self, environ: Mapping[str, str]) -> str | None:
        if self.trace_path is not None:
            return self.trace_path
        return next((environ[name] for name in TRACE_PATH_VARIABLES if environ.get(name)), None)

    @staticmethod
    def settings() -> list[Setting]:
        """The engine's settings, flags and file keys alike."""
        return settings_of(EngineArgs)

    @staticmethod
    def flag_notes() -> dict[str, str]:
        """What the help of the engine's flags adds from the registries: the policies and
        their options."""
        return {"scheduling_policy": f"{', '.join(POLICIES)} or a module:Class path",
                "policy_options": policy_options_help(EngineArgs.scheduling_policy)}

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Adds the flag of each engine setting (`engine.engine_args.flags.add_flags`)."""
        add_flags(parser, EngineArgs.settings(), notes=EngineArgs.flag_notes())

    @staticmethod
    def cli_flags(args: argparse.Namespace) -> list[str]:
        """The engine flags that reproduce `args` (parsed by `add_cli_args`), for a child
        process; ValueError for a setting that only a config file gives."""
        return flags_of(vars(args), EngineArgs.settings())

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        values = {spec.name: getattr(args, spec.name) for spec in fields(cls)}
        if not isinstance(values["policy_options"], Mapping):
            values["policy_options"] = tuple(values["policy_options"])
        return cls(**values)
