"""Token bookkeeping for multi-turn episodes: never re-tokenize what was already sent or sampled.

An episode's token ids grow by appending: the first prompt (chat template rendered once), then
each turn's sampled ids exactly as the engine returned them, then the ids of the template text
that closes the assistant turn and opens the next user turn (with the observation) and the next
assistant header. The ids sent to the engine on turn k are therefore exactly the stored prefix,
so what the trainer scores is what the behaviour policy saw.
"""

from __future__ import annotations

_OBS = "\x00OBSERVATION\x00"


class ChatTokens:
    """Splits a chat template into the pieces needed to extend a conversation by ids.

    Raises:
        ValueError: the tokenizer's chat template does not render conversations as prefixes of
            their extensions (such templates cannot be extended without re-tokenizing).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        probe = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
        opened = self._render(probe, generation_prompt=True)
        closed = self._render([*probe, {"role": "assistant", "content": "A"}], generation_prompt=False)
        extended = self._render([*probe, {"role": "assistant", "content": "A"}, {"role": "user", "content": _OBS}],
                                generation_prompt=True)
        if not closed.startswith(opened + "A") or not extended.startswith(closed):
            raise ValueError("chat template is not prefix-stable; cannot extend episodes by token ids")
        self.turn_closing = closed[len(opened) + 1:]  # e.g. "<|im_end|>\n"
        self.user_open, self.user_close = extended[len(closed):].split(_OBS)
        self.eos_token_id = tokenizer.eos_token_id
        self.eos_text = tokenizer.eos_token or ""

    def _render(self, messages, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Ids of the opening conversation, ending with the assistant header."""
        return self.tokenizer.encode(self._render(messages, True), add_special_tokens=False)

    def continuation_ids(self, sampled_ids: list[int], observation: str) -> list[int]:
        """Ids to append after a turn's sampled ids: turn closing, user message, assistant header.

        When the sampled ids already end with the EOS token that the template's closing starts
        with (e.g. ``<|im_end|>``), only the rest of the closing is added.
        """
        closing = self.turn_closing
        if sampled_ids and sampled_ids[-1] == self.eos_token_id and self.eos_text and closing.startswith(self.eos_text):
            closing = closing[len(self.eos_text):]
        return self.tokenizer.encode(closing + self.user_open + observation + self.user_close, add_special_tokens=False)
