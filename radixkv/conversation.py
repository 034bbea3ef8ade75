"""The token ids of a conversation, grown turn by turn so each prompt extends the last exactly.

Turn k's prompt must be turn k-1's prompt, then the reply the engine generated, then the new
user message, token for token: that is what lets the prefix cache serve the whole earlier
conversation. Re-rendering the history as text and tokenizing it again would break this
whenever a reply does not survive a decode/encode round trip (a byte-level model emits invalid
UTF-8 easily). So replies are kept as the ids that were generated, and the chat template is
rendered with a placeholder in each reply's place; the text between placeholders is tokenized
piece by piece and the reply ids are spliced in. A template renders a growing conversation as a
growing text, so every piece of turn k-1 reappears unchanged in turn k.

Token-id conversations (no tokenizer, or ids given) are plain concatenation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_REPLY = "\x00radixkv-reply-{}\x00"


class Conversation:
    """`prompt(user)` returns the prompt for the user's new message; `add_reply(...)` then
    commits the message and the reply together. A prompt that is never answered (the engine
    refused it, say) leaves the conversation as it was."""

    def __init__(self, tokenizer: Any | None, system: str | list[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.uses_ids = tokenizer is None or isinstance(system, list)
        self.messages: list[dict[str, str]] = []
        self._replies: list[list[int]] = []
        self._ids: list[int] = []  # id conversations: everything so far
        self._pending: str | list[int] | None = None
        if isinstance(system, list):
            self._ids = list(system)
        elif system is not None:
            if tokenizer is None:
                raise ValueError("a text system prompt needs a model with a tokenizer")
            self.messages.append({"role": "system", "content": system})

    def prompt(self, user: str | list[int]) -> list[int]:
        """The whole prompt for a reply to the user's new message."""
        if isinstance(user, list) != self.uses_ids:
            kind = "token ids" if self.uses_ids else "text"
            raise ValueError(f"this conversation takes {kind} for every message, got {type(user).__name__}")
        self._pending = user
        if self.uses_ids:
            return self._ids + user
        return self._render(self.messages + [{"role": "user", "content": user}])

    def add_reply(self, token_ids: list[int], text: str = "") -> None:
        """Commits the pending user message and the generated reply: its exact ids for the
        prompts to come, its text for `messages`."""
        if self._pending is None:
            raise ValueError("add_reply needs a prompt() first")
        if self.uses_ids:
            self._ids += self._pending + token_ids
        else:
            self.messages += [
                {"role": "user", "content": self._pending},
                {"role": "assistant", "content": text},
            ]
        self._replies.append(list(token_ids))
        self._pending = None

    @property
    def replies(self) -> list[list[int]]:
        """Each committed reply's ids, oldest first: with the users' messages, all that
        `resumed` needs to take the conversation up again elsewhere."""
        return [list(reply) for reply in self._replies]

    @classmethod
    def resumed(
        cls,
        tokenizer: Any | None,
        system: str | list[int] | None,
        users: list[str | list[int]],
        replies: list[list[int]],
    ) -> Conversation:
        """The conversation in which each of `users` was answered by the reply at its index, as
        another process held it (a restarted replay's second part): its next prompt is the one
        that process would have sent. A text conversation's `messages` hold empty replies there,
        since prompts use the reply ids and never their text."""
        if len(users) != len(replies):
            raise ValueError(f"resumed needs one reply per user message, got {len(users)} and {len(replies)}")
        conv = cls(tokenizer, system)
        for user, reply in zip(users, replies, strict=True):
            conv.prompt(user)
            conv.add_reply(reply)
        return conv

    def _render(self, messages: list[dict[str, str]]) -> list[int]:
        assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        return render_chat(self.tokenizer, messages, dict(zip(assistant, self._replies, strict=True)))


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    reply_ids: Mapping[int, list[int]],
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The prompt ids of `messages` (and `tools`, for a template that renders them) through the
    chat template, with the generation prompt; the message at each index of `reply_ids` stands
    as those exact ids, in place of its tokenized text."""
    shown = [
        {"role": m["role"], "content": _REPLY.format(i)} if i in reply_ids else m
        for i, m in enumerate(messages)
    ]
    extra = {"tools": tools} if tools else {}
    text = tokenizer.apply_chat_template(shown, tokenize=False, add_generation_prompt=True, **extra)
    ids: list[int] = []
    for i in sorted(reply_ids):
        head, text = text.split(_REPLY.format(i), 1)
        ids += _encode(tokenizer, head) + reply_ids[i]
    return ids + _encode(tokenizer, text)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) if text else []
