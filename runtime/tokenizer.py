"""A generative model's text side, from its bundle: `tokenizer.json` (Hugging Face tokenizers),
`tokenizer_config.json` (special tokens and the chat template) and `generation_config.json`
(end-of-sequence tokens). The chat template is Jinja, rendered in a sandbox as transformers
renders it, so a bundle's template gives the same prompt here as there.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
# transformers >= 4.43 (and optimum's exports) may keep the chat template in a file of its own
CHAT_TEMPLATE_FILE = "chat_template.jinja"
BUNDLE_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, GENERATION_CONFIG_FILE, CHAT_TEMPLATE_FILE)
REQUIRED_FILES = (TOKENIZER_FILE,)


class TokenizerError(ValueError):
    """A bundle file that cannot be used, or a chat that its template cannot render."""


def _token_text(value: Any) -> str | None:
    # special tokens are strings or AddedToken dicts ({"content": "<|endoftext|>", ...})
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@dataclass
class TextCodec:
    """Encoding, decoding and chat formatting for one model."""

    tokenizer: Any  # tokenizers.Tokenizer
    config: dict[str, Any]
    generation: dict[str, Any]

    @staticmethod
    def from_files(files: Mapping[str, bytes]) -> TextCodec:
        """From the bundle's files by name; TokenizerError naming the file that is wrong."""
        from tokenizers import Tokenizer

        if TOKENIZER_FILE not in files:
            raise TokenizerError(f"the bundle has no {TOKENIZER_FILE}")
        try:
            tokenizer = Tokenizer.from_str(files[TOKENIZER_FILE].decode("utf-8"))
        except Exception as exc:  # noqa: BLE001  the library raises plain Exceptions on bad files
            raise TokenizerError(
                f"{TOKENIZER_FILE} is not a tokenizer the tokenizers library reads: {exc}"
            ) from None
        config = _json_file(files, TOKENIZER_CONFIG_FILE)
        generation = _json_file(files, GENERATION_CONFIG_FILE)
        if CHAT_TEMPLATE_FILE in files:
            try:
                config["chat_template"] = files[CHAT_TEMPLATE_FILE].decode("utf-8")
            except UnicodeDecodeError:
                raise TokenizerError(f"{CHAT_TEMPLATE_FILE} is not UTF-8 text") from None
        codec = TextCodec(tokenizer, config, generation)
        template = config.get("chat_template")
        if template is not None and not isinstance(template, str):
            # a list of named templates: the default one serves chat
            named = (
                {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
                if isinstance(template, list)
                else {}
            )
            if not isinstance(named.get("default"), str):
                raise TokenizerError(
                    f"{TOKENIZER_CONFIG_FILE}: chat_template must be a string or name a 'default' template"
                )
            config["chat_template"] = named["default"]
        if config.get("chat_template"):
            codec._compiled_template()  # a syntax error is the upload's 400, not the first chat's
        return codec

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def _special(self, name: str) -> str | None:
        return _token_text(self.config.get(name))

    def eos_token_ids(self) -> tuple[int, ...]:
        found: list[int] = []
        configured = self.generation.get("eos_token_id")
        for value in configured if isinstance(configured, list) else [configured]:
            if isinstance(value, int):
                found.append(value)
        eos = self._special("eos_token")
        if eos is not None and (token := self.tokenizer.token_to_id(eos)) is not None:
            found.append(int(token))
        return tuple(dict.fromkeys(found))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)
        bos = self._special("bos_token")
        if add_special_tokens and self.config.get("add_bos_token") and bos is not None:
            bos_id = self.tokenizer.token_to_id(bos)
            if bos_id is not None and ids[:1] != [bos_id]:
                ids.insert(0, int(bos_id))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    @property
    def has_chat_template(self) -> bool:
        return bool(self.config.get("chat_template"))

    def _compiled_template(self):
        template = self.__dict__.get("_template")
        if template is None:
            from jinja2 import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise TokenizerError(f"the chat template refused the messages: {message}")

            environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            environment.globals["raise_exception"] = raise_exception
            environment.filters["tojson"] = lambda value, indent=None: json.dumps(
                value, indent=indent, ensure_ascii=False
            )
            try:
                template = environment.from_string(self.config["chat_template"])
            except TemplateError as exc:
                raise TokenizerError(
                    f"{TOKENIZER_CONFIG_FILE}: the chat template does not parse: {exc}"
                ) from None
            self.__dict__["_template"] = template
        return template

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt the model's template makes of `messages`; TokenizerError when it has no
        template or the template fails on them."""
        if not self.has_chat_template:
            raise TokenizerError(
                "this model's bundle has no chat template (tokenizer_config.json chat_template): use completions"
            )
        from jinja2 import TemplateError

        context = {
            "messages": [dict(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
            **{
                name: self._special(name) or ""
                for name in ("bos_token", "eos_token", "pad_token", "unk_token")
            },
        }
        try:
            return str(self._compiled_template().render(**context))
        except TokenizerError:
            raise
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise TokenizerError(
                f"the chat template failed on these messages: {type(exc).__name__}: {exc}"
            ) from None


class IncrementalText:
    """The text of a growing list of token ids, handed out as new pieces: a piece is held back
    while it ends inside a multi-byte character, or while it could be the start of a stop string
    (which then never reaches the client)."""

    def __init__(self, codec: TextCodec, stop: Sequence[str] = ()) -> None:
        self.codec = codec
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self.sent = ""  # the text handed out so far
        self.stopped = False
        # the text of ids[:_read], and the ids it is decoded from: a token's text is that of a
        # window from _prefix (a token or so before it, as a tokenizer's decoder may join or space
        # a token by its neighbour) less the window's text before _read. Decoding every id each
        # token cost O(length): 12 us a token at 128 tokens, 212 us at 2048, on the step loop.
        self._text = ""
        self._prefix = 0
        self._read = 0

    def add(self, token_id: int) -> str:
        """The new text after `token_id` (may be empty); sets `stopped` when a stop string appears."""
        self.ids.append(token_id)
        if not self._decode():
            return ""  # inside a multi-byte character: wait for the token that completes it
        text = self._text
        for stop in self.stop:
            at = text.find(stop, max(0, len(self.sent) - len(stop)))
            if at >= 0:
                self.stopped = True
                return self._hand_out(text[:at])
        held = max((_overlap(text, stop) for stop in self.stop), default=0)
        return self._hand_out(text[: len(text) - held])

    def flush(self) -> str:
        """What is left when the generation ends without a stop string."""
        if self.stopped:
            return ""
        if self._read < len(self.ids) and not self._decode():
            self._text = self.codec.decode(self.ids)  # ends inside a character: as a whole decode has it
        return self._hand_out(self._text)

    def _decode(self) -> bool:
        """The text of every id into _text; False (nothing changed) while it ends inside a character."""
        before = self.codec.decode(self.ids[self._prefix : self._read]) if self._read > self._prefix else ""
        window = self.codec.decode(self.ids[self._prefix :])
        if window.endswith("\ufffd"):
            return False
        if window.startswith(before):
            self._text += window[len(before) :]
        else:  # the decoder rewrote the window's start by what followed: the whole text again
            self._text = self.codec.decode(self.ids)
        self._prefix, self._read = self._read, len(self.ids)
        return True

    def _hand_out(self, text: str) -> str:
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""
        piece = text[len(self.sent) :]
        self.sent = text
        return piece


class CodecCache:
    """Tokenizers of stored bundles, loaded once per bundle (the gateway encodes every prompt
    with one, a runtime decodes every token); the least recently used leave past `size`."""

    def __init__(self, store, size: int = 32) -> None:
        self.store = store
        self.size = size
        self._codecs: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, bundle: Mapping[str, Any]):
        key = bundle["key"]
        with self._lock:
            if key in self._codecs:
                self._codecs.move_to_end(key)
                return self._codecs[key]
        codec = TextCodec.from_files({name: self.store.get(f"{key}/{name}") for name in bundle["files"]})
        with self._lock:
            self._codecs[key] = codec
            while len(self._codecs) > self.size:
                self._codecs.popitem(last=False)
        return codec


def _overlap(text: str, stop: str) -> int:
    """The longest end of `text` that begins `stop`."""
    for size in range(min(len(stop) - 1, len(text)), 0, -1):
        if stop.startswith(text[-size:]):
            return size
    return 0


def _json_file(files: Mapping[str, bytes], name: str) -> dict[str, Any]:
    if name not in files:
        return {}
    try:
        value = json.loads(files[name])
    except (ValueError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise TokenizerError(f"{name} must hold a JSON object")
    return value


__all__ = ["BUNDLE_FILES", "CodecCache", "IncrementalText", "TextCodec", "TokenizerError"]
