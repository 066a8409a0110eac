"""SASS of a cubin as functions, basic blocks and source lines.

Reads `nvdisasm -c -gi` text: each instruction with its address, predicate,
opcode and branch targets, and the source line it came from (the innermost
line and, for inlined code, the line it was inlined at: nvdisasm prints one
level). Stdlib only.
"""
import re
import subprocess

_FUNCTION = re.compile(r"^\.text\.(\S+):$")
_INSTR = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)(.*?);")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_LINE = re.compile(r'^\s*//## File "([^"]+)", line (\d+)(?: inlined at "([^"]+)", line (\d+))?')
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")
_BRX_TARGETS = re.compile(r'BRANCH_TARGETS ([^"*]+)')
_CALL_TARGET = re.compile(r"`\(([^)]+)\)")


class Instr:
    __slots__ = ("addr", "pred", "op", "args", "where", "targets", "callee")

    def __init__(self, addr, pred, op, args, where):
        self.addr = addr
        self.pred = pred  # "" or e.g. "@!P0"
        self.op = op  # opcode with modifiers, e.g. "HMMA.1688.F32.TF32"
        self.args = args
        self.where = where  # ((file, line), (file, line) or None): innermost, inlined at
        self.targets = []  # label names
        self.callee = None

    @property
    def base(self):
        return self.op.split(".")[0]

    def __repr__(self):
        return "%05x %s %s%s" % (self.addr, self.pred, self.op, self.args)


class Function:
    def __init__(self, name):
        self.name = name
        self.instrs = []
        self.labels = {}  # label -> index of the instruction it precedes

    def index_of_label(self, label):
        return self.labels[label]


def disassemble(nvdisasm, cubin):
    """`nvdisasm -c -gi` of a cubin as text."""
    return subprocess.run([nvdisasm, "-c", "-gi", cubin], check=True, capture_output=True, text=True).stdout


def parse(text):
    """{mangled name: Function} of every code section in nvdisasm text."""
    functions = {}
    current = None
    where = (None, None)
    pending_labels = []
    for raw in text.splitlines():
        m = _FUNCTION.match(raw)
        if m:
            current = Function(m.group(1))
            functions[current.name] = current
            where = (None, None)
            pending_labels = []
            continue
        if current is None:
            continue
        m = _LINE.match(raw)
        if m:
            inner = (m.group(1), int(m.group(2)))
            outer = (m.group(3), int(m.group(4))) if m.group(3) else None
            where = (inner, outer)
            continue
        m = _LABEL.match(raw)
        if m:
            pending_labels.append(m.group(1))
            continue
        m = _INSTR.match(raw)
        if not m:
            continue
        instr = Instr(int(m.group(1), 16), (m.group(2) or "").strip(), m.group(3), m.group(4), where)
        if instr.base == "BRX":
            t = _BRX_TARGETS.search(raw)
            instr.targets = [s.strip() for s in t.group(1).split(",")] if t else []
        elif instr.base in ("BRA", "BSSY"):
            instr.targets = _TARGET.findall(raw)
        elif instr.base == "CALL":
            t = _CALL_TARGET.search(raw)
            instr.callee = t.group(1) if t else None
        for label in pending_labels:
            current.labels[label] = len(current.instrs)
        pending_labels = []
        current.instrs.append(instr)
    return functions


# ---------------------------------------------------------------------------
# Basic blocks.

def is_control(instr):
    """Ends a basic block: a branch, an exit or a return (not BSSY, a marker)."""
    return instr.base in ("BRA", "BRX", "EXIT", "RET", "JMP", "JMX")


def unconditional(instr):
    return instr.pred in ("", "@PT")


class Block:
    __slots__ = ("index", "first", "last", "succs", "fallthrough", "taken")

    def __init__(self, index, first, last):
        self.index = index
        self.first = first  # instruction indices, inclusive
        self.last = last
        self.succs = []  # block indices
        self.fallthrough = None
        self.taken = []

    def __repr__(self):
        return "B%d[%d..%d]" % (self.index, self.first, self.last)


def blocks_of(fn):
    """The function's basic blocks, in address order, with successors.

    BRA.DIV (taken only when the warp has diverged) and conditional EXIT /
    RET keep a fall-through; an unconditional BRA, EXIT or RET does not.
    """
    n = len(fn.instrs)
    leaders = {0}
    for label, index in fn.labels.items():
        if index < n:
            leaders.add(index)
    for i, instr in enumerate(fn.instrs):
        if is_control(instr) and i + 1 < n:
            leaders.add(i + 1)
    starts = sorted(leaders)
    block_at = {}
    blocks = []
    for k, start in enumerate(starts):
        end = (starts[k + 1] if k + 1 < len(starts) else n) - 1
        blocks.append(Block(k, start, end))
        block_at[start] = k
    for block in blocks:
        last = fn.instrs[block.last]
        falls = block.last + 1 < n
        if is_control(last):
            if last.base in ("BRA", "BRX"):
                block.taken = [block_at[fn.labels[t]] for t in last.targets if t in fn.labels]
            if last.base in ("EXIT", "RET") and unconditional(last):
                falls = False
            if last.base in ("BRA", "BRX", "JMP", "JMX") and unconditional(last) and not last.op.startswith("BRA.DIV"):
                falls = False
        if falls:
            block.fallthrough = block.index + 1
        block.succs = list(dict.fromkeys(([block.fallthrough] if falls else []) + block.taken))
    return blocks, block_at
