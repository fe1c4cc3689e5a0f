from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class SynthesizeRequest(_message.Message):
    __slots__ = ("prompt", "messages", "hints", "max_latency_ms", "max_tokens", "temperature", "top_k", "top_p", "seed", "logit_bias", "stop_strings", "stop_token_ids", "path", "registry_sequence", "request_id", "json_schema", "regex", "grammar", "cache_salt")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    HINTS_FIELD_NUMBER: _ClassVar[int]
    MAX_LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    REGISTRY_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    hints: _containers.RepeatedScalarFieldContainer[str]
    max_latency_ms: float
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    logit_bias: _containers.ScalarMap[int, float]
    stop_strings: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    path: str
    registry_sequence: int
    request_id: str
    json_schema: str
    regex: str
    grammar: str
    cache_salt: str
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., hints: _Optional[_Iterable[str]] = ..., max_latency_ms: _Optional[float] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., stop_strings: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., path: _Optional[str] = ..., registry_sequence: _Optional[int] = ..., request_id: _Optional[str] = ..., json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class Rejection(_message.Message):
    __slots__ = ("path", "path_hash", "why", "detail")
    PATH_FIELD_NUMBER: _ClassVar[int]
    PATH_HASH_FIELD_NUMBER: _ClassVar[int]
    WHY_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    path: str
    path_hash: str
    why: str
    detail: str
    def __init__(self, path: _Optional[str] = ..., path_hash: _Optional[str] = ..., why: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class HintCorrection(_message.Message):
    __slots__ = ("given", "corrected")
    GIVEN_FIELD_NUMBER: _ClassVar[int]
    CORRECTED_FIELD_NUMBER: _ClassVar[int]
    given: str
    corrected: str
    def __init__(self, given: _Optional[str] = ..., corrected: _Optional[str] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("path", "refs", "path_hash", "kind", "hints", "corrected_hints", "predicted_ms", "degraded", "reason", "notes", "registry_sequence", "max_tokens", "tokens_that_fit", "rejected", "quality_json", "request_id")
    class PredictedMsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    PATH_FIELD_NUMBER: _ClassVar[int]
    REFS_FIELD_NUMBER: _ClassVar[int]
    PATH_HASH_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    HINTS_FIELD_NUMBER: _ClassVar[int]
    CORRECTED_HINTS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_MS_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NOTES_FIELD_NUMBER: _ClassVar[int]
    REGISTRY_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_THAT_FIT_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    QUALITY_JSON_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    path: str
    refs: _containers.RepeatedScalarFieldContainer[str]
    path_hash: str
    kind: str
    hints: _containers.RepeatedScalarFieldContainer[str]
    corrected_hints: _containers.RepeatedCompositeFieldContainer[HintCorrection]
    predicted_ms: _containers.ScalarMap[str, float]
    degraded: bool
    reason: str
    notes: _containers.RepeatedScalarFieldContainer[str]
    registry_sequence: int
    max_tokens: int
    tokens_that_fit: int
    rejected: _containers.RepeatedCompositeFieldContainer[Rejection]
    quality_json: str
    request_id: str
    def __init__(self, path: _Optional[str] = ..., refs: _Optional[_Iterable[str]] = ..., path_hash: _Optional[str] = ..., kind: _Optional[str] = ..., hints: _Optional[_Iterable[str]] = ..., corrected_hints: _Optional[_Iterable[_Union[HintCorrection, _Mapping]]] = ..., predicted_ms: _Optional[_Mapping[str, float]] = ..., degraded: _Optional[bool] = ..., reason: _Optional[str] = ..., notes: _Optional[_Iterable[str]] = ..., registry_sequence: _Optional[int] = ..., max_tokens: _Optional[int] = ..., tokens_that_fit: _Optional[int] = ..., rejected: _Optional[_Iterable[_Union[Rejection, _Mapping]]] = ..., quality_json: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("tokens_in", "tokens_out", "compute_seconds")
    TOKENS_IN_FIELD_NUMBER: _ClassVar[int]
    TOKENS_OUT_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    tokens_in: int
    tokens_out: int
    compute_seconds: float
    def __init__(self, tokens_in: _Optional[int] = ..., tokens_out: _Optional[int] = ..., compute_seconds: _Optional[float] = ...) -> None: ...

class Trace(_message.Message):
    __slots__ = ("path", "path_hash", "refs", "hints", "degraded", "reason", "predicted_ms", "actual_ms", "registry_sequence", "corrected_hints", "decode_chunks", "program_cache_hit", "prefix_cache_tokens")
    class PredictedMsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class ActualMsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    PATH_FIELD_NUMBER: _ClassVar[int]
    PATH_HASH_FIELD_NUMBER: _ClassVar[int]
    REFS_FIELD_NUMBER: _ClassVar[int]
    HINTS_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_MS_FIELD_NUMBER: _ClassVar[int]
    ACTUAL_MS_FIELD_NUMBER: _ClassVar[int]
    REGISTRY_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    CORRECTED_HINTS_FIELD_NUMBER: _ClassVar[int]
    DECODE_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    path: str
    path_hash: str
    refs: _containers.RepeatedScalarFieldContainer[str]
    hints: _containers.RepeatedScalarFieldContainer[str]
    degraded: bool
    reason: str
    predicted_ms: _containers.ScalarMap[str, float]
    actual_ms: _containers.ScalarMap[str, float]
    registry_sequence: int
    corrected_hints: _containers.RepeatedCompositeFieldContainer[HintCorrection]
    decode_chunks: int
    program_cache_hit: bool
    prefix_cache_tokens: int
    def __init__(self, path: _Optional[str] = ..., path_hash: _Optional[str] = ..., refs: _Optional[_Iterable[str]] = ..., hints: _Optional[_Iterable[str]] = ..., degraded: _Optional[bool] = ..., reason: _Optional[str] = ..., predicted_ms: _Optional[_Mapping[str, float]] = ..., actual_ms: _Optional[_Mapping[str, float]] = ..., registry_sequence: _Optional[int] = ..., corrected_hints: _Optional[_Iterable[_Union[HintCorrection, _Mapping]]] = ..., decode_chunks: _Optional[int] = ..., program_cache_hit: _Optional[bool] = ..., prefix_cache_tokens: _Optional[int] = ...) -> None: ...

class Final(_message.Message):
    __slots__ = ("finish_reason", "usage", "trace", "text", "prompt_token_ids")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    usage: Usage
    trace: Trace
    text: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., trace: _Optional[_Union[Trace, _Mapping]] = ..., text: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SynthesizeResponse(_message.Message):
    __slots__ = ("request_id", "plan", "delta", "final")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    plan: Plan
    delta: Delta
    final: Final
    def __init__(self, request_id: _Optional[str] = ..., plan: _Optional[_Union[Plan, _Mapping]] = ..., delta: _Optional[_Union[Delta, _Mapping]] = ..., final: _Optional[_Union[Final, _Mapping]] = ...) -> None: ...

class Delta(_message.Message):
    __slots__ = ("token_ids", "text")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ...) -> None: ...

class ListThoughtletsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Thoughtlet(_message.Message):
    __slots__ = ("name", "version", "kind", "layer_start", "layer_end", "versioned_hash", "param_bytes", "description", "tags", "signed")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    VERSIONED_HASH_FIELD_NUMBER: _ClassVar[int]
    PARAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    TAGS_FIELD_NUMBER: _ClassVar[int]
    SIGNED_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    kind: str
    layer_start: int
    layer_end: int
    versioned_hash: str
    param_bytes: int
    description: str
    tags: _containers.RepeatedScalarFieldContainer[str]
    signed: bool
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., kind: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., versioned_hash: _Optional[str] = ..., param_bytes: _Optional[int] = ..., description: _Optional[str] = ..., tags: _Optional[_Iterable[str]] = ..., signed: _Optional[bool] = ...) -> None: ...

class ListThoughtletsResponse(_message.Message):
    __slots__ = ("registry_sequence", "thoughtlets")
    REGISTRY_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    THOUGHTLETS_FIELD_NUMBER: _ClassVar[int]
    registry_sequence: int
    thoughtlets: _containers.RepeatedCompositeFieldContainer[Thoughtlet]
    def __init__(self, registry_sequence: _Optional[int] = ..., thoughtlets: _Optional[_Iterable[_Union[Thoughtlet, _Mapping]]] = ...) -> None: ...

class RegistryStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RegistryStatsResponse(_message.Message):
    __slots__ = ("registry_sequence", "signed", "stats_json", "planner_json", "in_flight", "waiting")
    REGISTRY_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    SIGNED_FIELD_NUMBER: _ClassVar[int]
    STATS_JSON_FIELD_NUMBER: _ClassVar[int]
    PLANNER_JSON_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    registry_sequence: int
    signed: bool
    stats_json: str
    planner_json: str
    in_flight: int
    waiting: int
    def __init__(self, registry_sequence: _Optional[int] = ..., signed: _Optional[bool] = ..., stats_json: _Optional[str] = ..., planner_json: _Optional[str] = ..., in_flight: _Optional[int] = ..., waiting: _Optional[int] = ...) -> None: ...

class ReloadRegistryRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReloadRegistryResponse(_message.Message):
    __slots__ = ("serving_sequence", "published_sequence", "switched", "previous_sequence", "calibration", "dropped_paths", "warmed_paths", "notes")
    SERVING_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    SWITCHED_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_FIELD_NUMBER: _ClassVar[int]
    DROPPED_PATHS_FIELD_NUMBER: _ClassVar[int]
    WARMED_PATHS_FIELD_NUMBER: _ClassVar[int]
    NOTES_FIELD_NUMBER: _ClassVar[int]
    serving_sequence: int
    published_sequence: int
    switched: bool
    previous_sequence: int
    calibration: str
    dropped_paths: _containers.RepeatedScalarFieldContainer[str]
    warmed_paths: _containers.RepeatedScalarFieldContainer[str]
    notes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, serving_sequence: _Optional[int] = ..., published_sequence: _Optional[int] = ..., switched: _Optional[bool] = ..., previous_sequence: _Optional[int] = ..., calibration: _Optional[str] = ..., dropped_paths: _Optional[_Iterable[str]] = ..., warmed_paths: _Optional[_Iterable[str]] = ..., notes: _Optional[_Iterable[str]] = ...) -> None: ...
