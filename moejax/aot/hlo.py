"""Reading compiled HLO text: computations, instructions and their parts.

The one reader of `compiled.as_text()` that `moejax.aot.windows` (what runs inside each
collective's window) and `moejax.aot.schedule` (the schedule replayed on a device model) share.
The text is XLA's: a computation starts at an unindented line `[ENTRY ]%name (...) -> ... {` and
ends at `}`; an instruction is `[ROOT ]%name = <shape> <opcode>(<operands>), <attributes>`,
where the shape may be a tuple `(f32[2]{0}, s32[])` and an operand list may nest parentheses.

>>> text = '''HloModule m, num_partitions=2
... ENTRY %main (x: f32[4]) -> f32[4] {
...   %x = f32[4]{0} parameter(0)
...   ROOT %y = f32[4]{0} add(%x, %x), metadata={op_name="jit(f)/add"}
... }'''
>>> [(i.name, i.opcode, i.operands, op_name(i.line)) for i in entry(text)]
[('x', 'parameter', (), ''), ('y', 'add', ('x', 'x'), 'jit(f)/add')]
"""

from __future__ import annotations

import dataclasses
import re

INSTRUCTION = re.compile(r"\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*")
_HEADER = re.compile(r"(?:ENTRY\s+)?%([\w.\-]+)")
_OPCODE = re.compile(r"([\w\-$]+)\(")
_OPERAND = re.compile(r"%([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class Instr:
    """One instruction line, split.

    Attributes:
      name: without the `%`.
      shape: the result shape as written (`bf16[8,128]{1,0}`, or a parenthesised tuple).
      opcode: `fusion`, `custom-call`, `all-to-all-start`, ...
      operands: the names (without `%`) between the opcode's parentheses.
      attrs: the text after them (`, kind=kLoop, calls=%f, metadata={...}`).
      line: the whole line.
    """

    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attrs: str
    line: str


def _close(text: str, i: int) -> int:
    """Index of the `)` matching the `(` at `text[i]`."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "(":
            depth += 1
        elif text[j] == ")":
            depth -= 1
            if depth == 0:
                return j
    raise ValueError(f"unbalanced parentheses in {text[:120]!r}")


def instruction(line: str) -> Instr | None:
    """An instruction line of HLO text as its parts, or None for other lines."""
    m = INSTRUCTION.match(line)
    if not m:
        return None
    rest = line[m.end() :]
    if rest.startswith("("):
        end = _close(rest, 0)
        shape, rest = rest[: end + 1], rest[end + 1 :].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    op = _OPCODE.match(rest)
    if not op:
        return None
    end = _close(rest, op.end() - 1)
    operands = tuple(_OPERAND.findall(rest[op.end() : end]))
    return Instr(m.group(1), shape, op.group(1), operands, rest[end + 1 :], line)


def computations(text: str) -> tuple[dict[str, list[str]], str, int]:
    """`({computation name: its instruction lines}, ENTRY's name, devices)` of compiled HLO
    text; devices is `num_partitions * replica_count` of the module header (1 if absent).

    Raises:
      ValueError: the text has no ENTRY computation.
    """
    comps: dict[str, list[str]] = {}
    entry_name, current = "", None
    for line in text.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace() and line.rstrip().endswith("{"):
            m = _HEADER.match(line)
            if m:
                current = m.group(1)
                comps[current] = []
                if line.startswith("ENTRY"):
                    entry_name = current
            continue
        if line.startswith("}"):
            current = None
        elif current is not None:
            comps[current].append(line)
    if not entry_name:
        raise ValueError("no ENTRY computation in the HLO text")
    devices = 1
    for key in ("num_partitions", "replica_count"):
        m = re.search(rf"\b{key}=(\d+)", text)
        devices *= int(m.group(1)) if m else 1
    return comps, entry_name, devices


def parsed(lines) -> list[Instr]:
    """The instructions among `lines`, in order (other lines skipped)."""
    return [i for i in map(instruction, lines) if i is not None]


def entry(text: str) -> list[Instr]:
    """The ENTRY computation's instructions in schedule order (a scheduled module's text lists
    them in the order the device runs them)."""
    comps, entry_name, _ = computations(text)
    return parsed(comps[entry_name])


def op_name(line: str) -> str:
    """The `op_name` of an instruction's metadata (the jax scope that made it), or ""."""
    m = _OP_NAME.search(line)
    return m.group(1) if m else ""


def count_ops(text: str, opcode: str) -> int:
    """Instructions of `opcode`, synchronous (`opcode(`) or async (`opcode-start(`), in every
    computation of the module."""
    comps, _, _ = computations(text)
    wanted = (opcode, f"{opcode}-start")
    return sum(i.opcode in wanted for lines in comps.values() for i in parsed(lines))
