"""Request bodies of the OpenAI-compatible API: strict types and bounds, checked before any work is
queued or any byte of a response is sent.

Every field a request may carry is either implemented or refused with a 400 that names it: unknown
fields are refused too (``extra="forbid"``), so nothing a caller asks for is silently ignored.
Numbers are strict (``true`` is not 1), floats finite, strings valid Unicode (no lone surrogates).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, ValidationError

from solo.engine.sampling import LOGPROB_TOP

MAX_N = 16  # choices per request (n); a list of prompts times n is bounded by MAX_CHOICES
MAX_CHOICES = 64
MAX_PROMPTS = 64
MAX_STOP = 16  # stop strings per request
MAX_STOP_CHARS = 256  # characters per stop string
MAX_LOGIT_BIAS = 300  # entries (OpenAI's limit)
MAX_MESSAGES = 1024
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts

Int = Annotated[int, Field(strict=True)]
Float = Annotated[float, Field(strict=True, allow_inf_nan=False)]


class ApiError(Exception):
    """An error answered in the OpenAI shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    def clean(text: str | None) -> str | None:  # a message may quote the input: never a lone surrogate
        return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")

    return {"error": {"message": clean(message), "type": type, "param": clean(param), "code": code}}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def check(self) -> None:
        """Checks across fields, after the types (ApiError naming the field)."""


class StreamOptions(Strict):
    include_usage: StrictBool | None = None


class SamplingFields(Strict):
    """Fields shared by /v1/completions and /v1/chat/completions (null means "not given")."""

    model: StrictStr | None = None
    max_tokens: Annotated[int, Field(strict=True, ge=0)] | None = None
    temperature: Annotated[float, Field(strict=True, allow_inf_nan=False, ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(strict=True, allow_inf_nan=False, gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(strict=True, ge=0)] | None = None  # extension (vLLM, SGLang): 0 = off
    n: Annotated[int, Field(strict=True, ge=1, le=MAX_N)] | None = None
    seed: Annotated[int, Field(strict=True, ge=SEED_RANGE[0], le=SEED_RANGE[1])] | None = None
    stop: (
        Annotated[StrictStr, Field(min_length=1, max_length=MAX_STOP_CHARS)]
        | Annotated[
            list[Annotated[StrictStr, Field(min_length=1, max_length=MAX_STOP_CHARS)]], Field(max_length=MAX_STOP)
        ]
        | None
    ) = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Field(strict=True, allow_inf_nan=False, ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(strict=True, allow_inf_nan=False, ge=-2, le=2)] | None = None
    logit_bias: (
        Annotated[
            dict[StrictStr, Annotated[float, Field(strict=True, allow_inf_nan=False, ge=-100, le=100)]],
            Field(max_length=MAX_LOGIT_BIAS),
        ]
        | None
    ) = None
    user: StrictStr | None = None  # an end-user id for the caller's records; generation does not read it
    ignore_eos: StrictBool | None = None  # extension: generate past the end-of-sequence token

    def refusals(self) -> list[tuple[str, str]]:
        """(field, why) for every field given that solo does not implement."""
        return []

    def check(self) -> None:
        refused = self.refusals()
        if refused:
            field, why = refused[0]
            more = f" (also refused: {', '.join(f for f, _ in refused[1:])})" if len(refused) > 1 else ""
            raise ApiError(400, f"{field}: {why}{more}", param=field)
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options: only allowed with stream: true.", param="stream_options")
        for token in self.logit_bias or {}:
            if not (token.isascii() and token.isdigit()):
                message = f'logit_bias: keys are token ids as strings (e.g. "42"), got {token!r}.'
                raise ApiError(400, message, "logit_bias")

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple(sorted((int(k), float(v)) for k, v in (self.logit_bias or {}).items()))

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


TokenIds = list[Annotated[int, Field(strict=True)]]


class CompletionRequest(SamplingFields):
    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    echo: StrictBool | None = None
    logprobs: Annotated[int, Field(strict=True, ge=0, le=LOGPROB_TOP)] | None = None
    suffix: Any = None  # refused when given
    best_of: Annotated[int, Field(strict=True, ge=1, le=MAX_N)] | None = None

    def refusals(self) -> list[tuple[str, str]]:
        out = []
        if self.suffix not in (None, ""):
            out.append(("suffix", "insertion after a suffix (fill-in-the-middle) is not implemented."))
        if self.best_of is not None and self.best_of != (self.n or 1):
            out.append(
                ("best_of", "ranking best_of candidates by log-probability is not implemented; use n (best_of = n).")
            )
        return out

    def check(self) -> None:
        super().check()
        prompts = self.prompts()
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ApiError(400, "prompt: must not be empty (give text or at least one token id).", "prompt")
        if len(prompts) > MAX_PROMPTS:
            raise ApiError(400, f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(prompts)}.", "prompt")
        if len(prompts) * (self.n or 1) > MAX_CHOICES:
            raise ApiError(400, f"n: prompts x n is at most {MAX_CHOICES}, got {len(prompts) * (self.n or 1)}.", "n")
        if self.max_tokens == 0 and not self.echo:
            raise ApiError(
                400, "max_tokens: must be >= 1 (0 is for scoring the prompt, with echo: true).", "max_tokens"
            )

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one string, one list of ids, or a list of either."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class Message(Strict):
    role: Literal["system", "developer", "user", "human", "assistant", "tool"]
    content: StrictStr | list[dict[str, Any]] | None = None
    name: Any = None  # refused: the Ling chat format has no participant names
    tool_calls: Any = None  # refused: no tool calling
    tool_call_id: StrictStr | None = None  # a tool result's call id: accepted, the template has no slot for it
    function_call: Any = None  # refused
    refusal: StrictStr | None = None  # an assistant's earlier refusal text: refused when given

    def text(self, index: int) -> str:
        where = f"messages[{index}]"
        for field in ("name", "tool_calls", "function_call", "refusal"):
            if getattr(self, field) not in (None, [], ""):
                why = {
                    "name": "participant names are not part of the Ling chat format; put them in the content.",
                    "tool_calls": "tool calling is not implemented.",
                    "function_call": "function calling is not implemented.",
                    "refusal": "assistant refusals are not implemented; send the text as content.",
                }[field]
                raise ApiError(400, f"{where}.{field}: {why}", param=f"{where}.{field}")
        if self.content is None:
            if self.role != "assistant":
                raise ApiError(400, f"{where}.content: required for role {self.role!r}.", param=f"{where}.content")
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for j, part in enumerate(self.content):
            kind = part.get("type")
            if kind != "text":
                raise ApiError(
                    400,
                    f"{where}.content[{j}].type: {kind!r} parts are not supported (solo serves text models; "
                    'give {"type": "text", "text": ...}).',
                    param=f"{where}.content",
                )
            extra = set(part) - {"type", "text"}
            if extra:
                raise ApiError(400, f"{where}.content[{j}]: unknown field(s) {sorted(extra)}.", f"{where}.content")
            if not isinstance(part.get("text"), str):
                raise ApiError(400, f"{where}.content[{j}].text: must be a string.", param=f"{where}.content")
            texts.append(part["text"])
        return "".join(texts)


class ChatRequest(SamplingFields):
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[int, Field(strict=True, ge=0, le=LOGPROB_TOP)] | None = None
    max_completion_tokens: Annotated[int, Field(strict=True, ge=1)] | None = None
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    store: StrictBool | None = None
    metadata: Any = None
    service_tier: StrictStr | None = None
    safety_identifier: StrictStr | None = None  # an end-user id, like `user`: generation does not read it

    def refusals(self) -> list[tuple[str, str]]:
        out = []
        if self.response_format not in (None, {"type": "text"}):
            out.append(
                (
                    "response_format",
                    "structured output (json_object, json_schema) is not implemented: there is no constrained "
                    'decoding; ask for JSON in the prompt, or omit the field ({"type": "text"} is accepted).',
                )
            )
        if self.tools not in (None, []):
            out.append(("tools", "tool calling is not implemented: the Ling chat format here defines no tool schema."))
        if self.tool_choice not in (None, "none") and not (self.tool_choice == "auto" and not self.tools):
            out.append(("tool_choice", 'tool calling is not implemented; only "none" is accepted.'))
        for field in ("parallel_tool_calls", "functions", "function_call"):
            if getattr(self, field) is not None:
                out.append((field, "tool and function calling are not implemented."))
        if self.modalities not in (None, ["text"]):
            out.append(("modalities", 'only ["text"] is served.'))
        for field in ("audio", "prediction", "reasoning_effort", "web_search_options"):
            if getattr(self, field) is not None:
                out.append((field, "not implemented by solo."))
        if self.store:
            out.append(("store", "solo stores no completions; omit it or send false."))
        if self.metadata not in (None, {}):
            out.append(("metadata", "metadata belongs to stored completions, which solo does not keep."))
        if self.service_tier not in (None, "auto", "default"):
            out.append(("service_tier", 'one tier is served: "auto" or "default".'))
        return out

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs: true.", "top_logprobs")
        if (
            self.max_tokens is not None
            and self.max_completion_tokens is not None
            and self.max_tokens != self.max_completion_tokens
        ):
            raise ApiError(
                400, "max_completion_tokens: differs from max_tokens; give one of them.", "max_completion_tokens"
            )
        if self.max_tokens == 0:
            raise ApiError(400, "max_tokens: must be >= 1.", "max_tokens")
        self.chat_messages()  # content parts and message fields are checked here, before any work

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text(i)} for i, m in enumerate(self.messages)]


class TokenizeRequest(Strict):
    """vLLM's /tokenize (what lm-evaluation-harness's remote tokenizer calls)."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    add_special_tokens: StrictBool | None = None  # solo's tokenizers add none either way


class DetokenizeRequest(Strict):
    model: StrictStr | None = None
    tokens: TokenIds


# --------------------------------------------------------------------------- parsing
def parse_body(model: type[Strict], raw: bytes) -> Any:
    """Bytes of a request body -> a validated request, or an ApiError(400) naming the problem."""
    try:
        data = json.loads(raw)
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the body is not valid UTF-8 ({e.reason} at byte {e.start}).") from None
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}.") from None
    except (ValueError, RecursionError) as e:  # e.g. an integer of more than 4300 digits, deep nesting
        raise ApiError(400, f"the body cannot be read as JSON: {e}.") from None
    if not isinstance(data, dict):
        kinds = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
        raise ApiError(400, f"the body must be a JSON object, got {kinds.get(type(data), 'null')}.")
    bad = _lone_surrogate(data)
    if bad is not None:
        raise ApiError(400, f"{bad}: invalid Unicode (a lone surrogate such as \\ud800).", param=bad)
    try:
        request = model.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e) from None
    request.check()
    return request


def _lone_surrogate(value: Any, path: str = "") -> str | None:
    """The path of the first string (key or value) that is not encodable as UTF-8, else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            where = f"{path}.{k}" if path else str(k)
            if _lone_surrogate(k, where) is not None:
                return where
            found = _lone_surrogate(v, where)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = _lone_surrogate(v, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def _validation_error(error: ValidationError) -> ApiError:
    """One message naming every field at fault (union alternatives collapsed into their field)."""
    by_field: dict[str, list[str]] = {}
    for e in error.errors(include_url=False):
        loc = [p for p in e["loc"] if not (isinstance(p, str) and _is_type_label(p))]
        name = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(loc))
        name = name or "body"
        if e["type"] == "extra_forbidden":
            msg = "unknown field: solo does not implement it (unknown fields are refused, never ignored)"
        elif e["type"] == "missing":
            msg = "required"
        else:
            msg = e["msg"]
        by_field.setdefault(name, [])
        if msg not in by_field[name]:
            by_field[name].append(msg)
    parts = [f"{name}: {' or '.join(msgs[:3])}" for name, msgs in by_field.items()]
    first = next(iter(by_field), None)
    param = first.split(".")[0].split("[")[0] if first else None
    return ApiError(400, "invalid request: " + "; ".join(parts), param=param)


def _is_type_label(part: str) -> bool:
    """Pydantic names union alternatives in error locations (``str``, ``list[int]``, ...)."""
    return (
        part in ("str", "int", "float", "bool", "dict", "list")
        or "[" in part
        or part.startswith(("function-", "constrained-", "json-or-python"))
    )
