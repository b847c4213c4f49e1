"""Megatron-Bridge 0.3.1 on rlkit's stack: megatron-core 0.16.1, transformers 5, with or without
TransformerEngine. `auto_bridge()` imports Megatron-Bridge with these fixes applied, once per process:

1. Where TransformerEngine is not installed, its modules are import-time placeholders while
   Megatron-Bridge imports (its LoRA layers import TE unguarded, and every AutoBridge import passes
   through them); afterwards every HAVE_TE* flag of the modules imported meanwhile reads False and
   the placeholders leave sys.modules, so nothing sees TE as installed. Megatron's local layer spec,
   which the backend builds, needs nothing from TE at run time.
2. Tensor-parallel loads scatter contiguous shards: a row-parallel weight (attention output and MLP
   down projection) is split along dim 1 into views whose storage is the whole tensor, which gloo
   sends as it lies in memory, so every rank received scrambled rows with no error.
3. transformers 5 keeps rope_theta and partial_rotary_factor in config.rope_parameters, where the
   bridge's config mapping does not look: the checkpoint's RoPE base and rotated fraction were
   replaced by Megatron's defaults (10000, all dimensions) with no error.
4. Megatron's local spec holds MoE experts as SequentialMLP (local_experts.<E>.linear_fc1.weight);
   a name table that maps only TEGroupedMLP's experts (linear_fc1.weight<E>, GLM-4.5's) gets the
   same conversions under the local names: the bridge skipped those weights with a log line.
5. At EP=1 an expert exports as itself: the export reads a SequentialMLP expert's number off the
   end of TEGroupedMLP's name first (ValueError). Across EP ranks the bridge numbers only grouped
   experts globally, so rlkit's validation keeps this backend at EP=1.
"""

import copy
import importlib.abc
import importlib.machinery
import importlib.util
import re
import sys
import types

from rlkit.bridge.base import transformer_engine_installed
from rlkit.bridge.common import rope_settings_in_parameters

_applied = False


def auto_bridge():
    """Megatron-Bridge's AutoBridge class, with the fixes above in place."""
    global _applied
    if not _applied:
        if not transformer_engine_installed():
            _import_without_transformer_engine("megatron.bridge")
        _contiguous_tensor_parallel_shards()
        _rope_from_rope_parameters()
        _local_expert_mappings()
        _local_experts_exported_at_ep1()
        _applied = True
    from megatron.bridge import AutoBridge

    return AutoBridge


class _PlaceholderType(type):
    """A TE class or function seen at import time: subclassing it and reading its attributes work
    (module-level code does both), using it fails by name."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        member = _PlaceholderType(f"{cls.__name__}.{name}", (), {})
        setattr(cls, name, member)
        return member

    def __call__(cls, *args, **kwargs):
        raise RuntimeError(f"{cls.__name__} is TransformerEngine's, which is not installed")


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        member = _PlaceholderType(f"{self.__name__}.{name}", (), {})
        setattr(self, name, member)
        return member


class _TransformerEngineFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname == "transformer_engine" or fullname.startswith("transformer_engine."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _PlaceholderModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def _import_without_transformer_engine(package: str):
    # megatron-core's own TE probes run first, without placeholders, so they find TE absent
    import megatron.core.extensions.transformer_engine  # noqa: F401
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401

    before = set(sys.modules)
    finder = _TransformerEngineFinder()
    sys.meta_path.insert(0, finder)
    try:
        importlib.import_module(package)
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n == "transformer_engine" or n.startswith("transformer_engine.")]:
            del sys.modules[name]
    for name in set(sys.modules) - before:
        module = sys.modules[name]
        if name.startswith("megatron.") and module is not None:
            for flag, value in list(vars(module).items()):
                if flag.startswith("HAVE_TE") and isinstance(value, bool):
                    setattr(module, flag, False)


def _contiguous_tensor_parallel_shards():
    from megatron.bridge.models.conversion.param_mapping import MegatronParamMapping

    scatter = MegatronParamMapping.scatter_to_tp_ranks

    def scatter_contiguous(self, splits, *args, **kwargs):
        return scatter(self, [s.contiguous() for s in splits] if splits else splits, *args, **kwargs)

    MegatronParamMapping.scatter_to_tp_ranks = scatter_contiguous


def _rope_from_rope_parameters():
    from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge

    to_provider_kwargs = MegatronModelBridge.hf_config_to_provider_kwargs

    def with_rope_parameters(self, hf_config) -> dict:
        kwargs = to_provider_kwargs(self, hf_config)
        megatron_keys = {"rope_theta": "rotary_base", "partial_rotary_factor": "rotary_percent"}
        for hf_key, value in rope_settings_in_parameters(hf_config).items():
            kwargs[megatron_keys[hf_key]] = value
        return kwargs

    MegatronModelBridge.hf_config_to_provider_kwargs = with_rope_parameters


# TEGroupedMLP's expert weights (linear_fc1.weight<E>), as a bridge's name table writes them
_GROUPED_EXPERTS = re.compile(r"(.*\.mlp\.experts\.)(linear_fc[12])\.(weight|bias)\*")


def _local_expert_mappings():
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry

    init = MegatronMappingRegistry.__init__

    def init_with_local_experts(self, *mappings):
        names = {mapping.megatron_param for mapping in mappings}
        local = []
        for mapping in mappings:
            grouped = _GROUPED_EXPERTS.fullmatch(mapping.megatron_param)
            name = grouped and f"{grouped[1]}local_experts.*.{grouped[2]}.{grouped[3]}"
            if grouped and name not in names:
                twin = copy.copy(mapping)  # the same conversion, wildcards in the same order
                twin.megatron_param = name
                local.append(twin)
        init(self, *mappings, *local)

    MegatronMappingRegistry.__init__ = init_with_local_experts


def _local_experts_exported_at_ep1():
    from megatron.bridge.models.conversion.param_mapping import MegatronParamMapping

    gather = MegatronParamMapping.gather_from_ep_ranks

    def gather_or_own(self, megatron_weights, megatron_module, hf_param_name):
        if self.ep_size == 1 and ".local_experts." in self.megatron_param:
            return {str(hf_param_name): megatron_weights}
        return gather(self, megatron_weights, megatron_module, hf_param_name)

    MegatronParamMapping.gather_from_ep_ranks = gather_or_own
