"""The scheduler -> runner seam: what one step runs, as typed work items.

One step is an encoder batch then a decoder batch::

    encoder batch  | prefill chunks (PREFILL) | one token per DECODE sequence | a chunk per VERIFY sequence |
    decoder batch  | replay segments (REPLAY) | one token per DECODE sequence | a chunk per VERIFY sequence |

A VERIFY chunk (speculative decoding, spec_*.py) is the sequence's known tokens then its drafts; the decoder
returns logits for every row of it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from flashtier.engine.core.request import Request, Sequence


class DecoderKind(enum.Enum):
    REPLAY = "replay"  # the decoder bounded replay over the prompt's newest window -> the first token
    DECODE = "decode"  # one new token
    VERIFY = "verify"  # speculative: known tokens + drafts in one chunk -> accepted drafts + one new token


@dataclass(frozen=True, slots=True)
class EncoderWork:
    request: Request
    seq: Sequence
    tokens: list[int]  # a prompt chunk, or the one token a DECODE sequence feeds


@dataclass(frozen=True, slots=True)
class DecoderWork:
    request: Request
    seq: Sequence
    kind: DecoderKind
    drafts: tuple[int, ...] = ()  # VERIFY: the drafts at the end of the chunk
    rows: int = 1  # VERIFY: the chunk's length (known tokens + drafts)


@dataclass
class SchedulerOutput:
    """What one step runs (scheduler -> runner -> postprocess)."""

    encoder: list[EncoderWork] = field(default_factory=list)
    decoder: list[DecoderWork] = field(default_factory=list)  # in this order (logits: ModelRunnerOutput)
    preempted: list[str] = field(default_factory=list)  # request ids preempted while scheduling
    num_tokens: int = 0  # of the token budget spent (encoder chunks + replay + decode tokens)

    @property
    def empty(self) -> bool:
        return not self.encoder and not self.decoder

    def drop(self, req: Request) -> int:
        """Forget the work scheduled for ``req`` in this step (it is being preempted); returns the
        budget that work had spent. Only decode work can be dropped (victims are picked before any
        prefill or replay of the step is scheduled), so that is its encoder tokens."""
        assert all(w.kind in (DecoderKind.DECODE, DecoderKind.VERIFY) for w in self.decoder if w.request is req)
        spent = sum(len(w.tokens) for w in self.encoder if w.request is req)
        self.encoder = [w for w in self.encoder if w.request is not req]
        self.decoder = [w for w in self.decoder if w.request is not req]
        return spent
