"""The steady-state iteration of a kernel's token loop, from its SASS.

How the loop and its path are found (docs/cuda.md, "Instruction budget"):

1. The token loop is the backward branch whose source line (from -lineinfo)
   matches the kind's `loop` pattern (`for (int tile = ...`): its target is
   the loop head, the branch ends the latch block. The body is every basic
   block from the head to the latch (ptxas lays loops out contiguously; an
   arm that leaves them is dead). Where ptxas made several copies of the
   loop (unswitching a loop-invariant branch), the widest copy whose walk
   succeeds and runs the instance's `keep` lines is the one counted.
2. One iteration is walked from the head to the latch. At a conditional
   branch (or a BRX) each successor arm is tested: an arm is dead when every
   path through it reaches an excluded instruction or leaves the loop.
   Excluded: a CALL to a slow path (`slowpath` in the callee's name) and,
   outside the blocks every path runs, each instruction whose source line or
   the line it was inlined at matches one of the `exclude` patterns (what a
   configuration does not run: the add-back without pairs, soft capping).
   One live arm: taken. Two: a predicate rule decides when one matches the
   instruction that set the branch's predicate (Config), else, when one arm
   is the branch's join (its immediate post-dominator), the guarded code
   runs (an `if` without `else` runs for the warp when any lane enters it),
   else the walk stops and names the branch, its predicate's setter and the
   arms' source lines. BRA.DIV (taken only by a diverged warp) falls
   through.
3. An inner loop (a backward branch inside the body) runs the trip count of
   the first `trips` rule that matches its back edge (its source line and,
   where lines do not tell loops apart, the compare that closes it); none:
   the walk stops. Its iteration's instructions count that many times.
4. Every instruction on the path counts once per execution, predicated or
   not (a predicated-off instruction still issues). The count is per warp;
   times the warps that run the loop body per iteration, divided by the
   tokens and KV heads one iteration covers, it is warp instructions per
   (token, KV head).
"""
import re

# Instruction classes (opcode before the first dot).
MMA = {"HMMA", "IMMA", "HGMMA", "IGMMA", "DMMA", "BMMA"}
MEMORY = {"LDG", "LDS", "LDC", "LDSM", "LDL", "LD", "ULDC", "LDGSTS", "STG", "STS", "STL", "ST", "ATOM", "ATOMS",
          "RED", "LDGDEPBAR", "LDTRAM"}
ADDRESS = {"IMAD", "IADD3", "IADD", "LEA", "VIADD", "IABS", "IMNMX", "VIMNMX", "UIMAD", "UIADD3", "ULEA", "UMOV",
           "MOV", "IMUL", "ISCADD", "VIADDMNMX", "VIMNMX3"}
BITS = {"LOP3", "SHF", "SHL", "SHR", "PRMT", "BFE", "BFI", "FLO", "POPC", "BREV", "ULOP3", "USHF", "LOP"}
FLOAT = {"FFMA", "FMUL", "FADD", "FMNMX", "MUFU", "FSETP", "FSEL", "F2F", "I2F", "F2I", "FRND", "FCHK", "F2FP",
         "HADD2", "HMUL2", "HFMA2", "FSET", "DFMA", "DADD", "DMUL", "F2I", "I2FP", "F2IP", "FSWZADD"}
CLASSES = ("mma", "memory", "address", "bits", "float", "other")


def instr_class(instr):
    base = instr.base
    if base in MMA:
        return "mma"
    if base in MEMORY:
        return "memory"
    if base in ADDRESS:
        return "address"
    if base in BITS:
        return "bits"
    if base in FLOAT:
        return "float"
    return "other"


class WalkError(Exception):
    pass


class Source:
    """Source lines by (file, line), read once."""

    def __init__(self):
        self._files = {}

    def line(self, where):
        if where is None:
            return ""
        path, number = where
        if path not in self._files:
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    self._files[path] = f.read().splitlines()
            except OSError:
                self._files[path] = []
        lines = self._files[path]
        return lines[number - 1] if 0 < number <= len(lines) else ""

    def texts(self, instr):
        inner, outer = instr.where
        return [self.line(inner), self.line(outer)]

    def describe(self, instr):
        inner, outer = instr.where
        parts = []
        for where in (inner, outer):
            if where:
                parts.append("%s:%d `%s`" % (where[0].rsplit("/", 1)[-1], where[1], self.line(where).strip()))
        return " inlined at ".join(parts) if parts else "(no line info)"


class Config:
    """What one configuration (a preset on an instance) takes of the loop.

    loop: pattern of the token loop's back-edge line. exclude: patterns of
    lines the configuration never runs. trips: inner loops' trip counts,
    each (line pattern, count) or a dict with `line` and / or `setter` (the
    SASS of the compare that closes the loop) and `count`. preds: predicate
    rules, each a dict with `setter` (pattern over the SASS text of the
    instruction that set the branch's predicate), optional `line` (its
    source lines), `branch_line` (the branch's) and `def` (the instruction
    that last wrote the compared register), and either `pred` (the
    predicate's value) or `value` (the compared register's value: the ISETP
    is evaluated). values: the names a count or a `value` may use; a rule
    naming one the configuration lacks is left out. require: patterns of
    lines the walked iteration must run (an instance's `keep`: picks the
    loop copy that holds them).
    """

    def __init__(self, loop, exclude=(), trips=(), preds=(), values=None, require=()):
        values = values or {}
        self.loop = re.compile(loop)
        self.exclude = [re.compile(p) for p in exclude]
        self.require = [re.compile(p) for p in require]
        self.trips = []
        for trip in trips:
            if isinstance(trip, dict):  # {line, setter (of the back edge's predicate), count, why}
                rule = {k: re.compile(trip[k]) for k in ("line", "setter") if k in trip}
                count = trip["count"]
            else:
                rule, count = {"line": re.compile(trip[0])}, trip[1]
            if isinstance(count, str) and count not in values:
                continue
            self.trips.append((rule, int(values.get(count, count)) if isinstance(count, str) else int(count)))
        self.preds = []
        for rule in preds:
            rule = dict(rule)
            for key in ("setter", "line", "def", "branch_line", "arm"):
                if key in rule:
                    rule[key] = re.compile(rule[key])
            if "value" in rule and isinstance(rule["value"], str):
                if rule["value"] not in values:
                    continue  # a value this configuration has no use for
                rule["value"] = values[rule["value"]]
            self.preds.append(rule)


def _matches(source, instr, pattern):
    return any(pattern.search(text) for text in source.texts(instr))


def _excluded(source, instr, config):
    if instr.base == "CALL" and instr.callee and "slowpath" in instr.callee:
        return True
    return any(_matches(source, instr, p) for p in config.exclude)


def find_loops(fn, blocks, block_at, source, config):
    """(header, latch) block indices of every copy of the token loop (ptxas
    may unswitch a loop-invariant branch into several), widest first; of
    nested matches only the outermost."""
    found = []
    for block in blocks:
        last = fn.instrs[block.last]
        if last.base != "BRA":
            continue
        for target in block.taken:
            if target <= block.index and _matches(source, last, config.loop):
                found.append((target, block.index))
    if not found:
        raise WalkError("no backward branch on a line matching /%s/" % config.loop.pattern)
    found.sort(key=lambda loop: loop[0] - loop[1])
    outer = []
    for header, latch in found:
        if not any(h <= header and latch <= l for h, l in outer):
            outer.append((header, latch))
    return outer


def find_loop(fn, blocks, block_at, source, config):
    """(header, latch) block indices of the token loop; the outermost match."""
    return find_loops(fn, blocks, block_at, source, config)[0]


def _mandatory(blocks, header, latch):
    """Blocks on every path from the header to the latch (the header's
    post-dominators, inner back edges and exits left out). A guard's compare
    shares its source line with what it guards; these blocks run whatever
    a configuration excludes."""
    pdom = {}
    for b in range(latch, header - 1, -1):
        succ = [s for s in blocks[b].succs if b < s <= latch]
        common = None
        for s in succ:
            common = set(pdom[s]) if common is None else common & pdom[s]
        pdom[b] = {b} | (common or set())
    return pdom[header] if latch in pdom[header] else {header, latch}


def _operands(instr):
    return [o.strip() for o in instr.args.split(",")]


def _writes(instr, reg):
    ops = _operands(instr)
    if not ops or ops[0].startswith("["):
        return False
    return ops[0] == reg or (ops[0].startswith("P") and len(ops) > 1 and ops[1] == reg)


_ISETP = re.compile(r"^ISETP\.(LT|LE|GT|GE|EQ|NE)(\.U32)?\.AND$")
_COMPARE = {"LT": lambda a, b: a < b, "LE": lambda a, b: a <= b, "GT": lambda a, b: a > b,
            "GE": lambda a, b: a >= b, "EQ": lambda a, b: a == b, "NE": lambda a, b: a != b}


def _immediate(text):
    if text == "RZ":
        return 0
    try:
        return int(text, 16) if "0x" in text else int(text)
    except ValueError:
        return None


def _evaluate(setter, value):
    """The ISETP's predicate with its first source register = value."""
    m = _ISETP.match(setter.op)
    ops = _operands(setter)
    if not m or len(ops) != 5 or ops[1] != "PT" or ops[4] != "PT":
        return None
    b = _immediate(ops[3])
    if b is None:
        return None
    a = value
    if m.group(2):
        a, b = a & 0xFFFFFFFF, b & 0xFFFFFFFF
    return _COMPARE[m.group(1)](a, b)


def _decide(source, config, trace, branch):
    """(predicate value, rule) for the branch's predicate from the rules, or
    (None, None)."""
    name = branch.pred.lstrip("@!")
    if not name.startswith("P") or name == "PT":
        return None, None
    index = next((i for i in range(len(trace) - 1, -1, -1) if _writes(trace[i], name)), None)
    if index is None:
        return None, None
    setter = trace[index]
    text = "%s %s" % (setter.op, setter.args.strip())
    for rule in config.preds:
        if "arm" in rule or not rule["setter"].search(text):
            continue
        if "line" in rule and not _matches(source, setter, rule["line"]):
            continue
        if "branch_line" in rule and not _matches(source, branch, rule["branch_line"]):
            continue
        if "def" in rule:
            ops = _operands(setter)
            reg = ops[2] if len(ops) > 2 else None
            d = next((trace[i] for i in range(index - 1, -1, -1) if _writes(trace[i], reg)), None)
            if d is None or not rule["def"].search("%s %s" % (d.op, d.args.strip())):
                continue
        if "pred" in rule:
            return bool(rule["pred"]), rule
        result = _evaluate(setter, int(rule["value"]))
        if result is not None:
            return result, rule
    return None, None


def _trip_matches(source, trace, branch, rule):
    if "line" in rule and not _matches(source, branch, rule["line"]):
        return False
    if "setter" in rule:
        name = branch.pred.lstrip("@!")
        setter = next((i for i in reversed(trace) if _writes(i, name)), None)
        if setter is None or not rule["setter"].search("%s %s" % (setter.op, setter.args.strip())):
            return False
    return True


def _liveness(fn, blocks, header, latch, source, config):
    """dead[b]: every path from block b hits an excluded instruction or leaves
    the loop. pdom[b]: b's post-dominators over live paths."""
    dead, pdom = {}, {}
    mandatory = _mandatory(blocks, header, latch)
    for b in range(latch, header - 1, -1):
        block = blocks[b]
        own = b not in mandatory and any(
            _excluded(source, fn.instrs[i], config) for i in range(block.first, block.last + 1))
        outcomes = []
        live_succ = []
        for s in block.succs:
            if b == latch and s == header:
                outcomes.append(False)  # the next iteration
            elif s <= b and s >= header:
                continue  # an inner loop's back edge
            elif s < header or s > latch:
                outcomes.append(True)  # leaves the loop
            else:
                outcomes.append(dead[s])
                if not dead[s]:
                    live_succ.append(s)
        dead[b] = own or not outcomes or all(outcomes)
        common = None
        for s in live_succ:
            common = set(pdom[s]) if common is None else common & pdom[s]
        pdom[b] = {b} | (common or set())
    return dead, pdom


def _choose_arm(fn, blocks, source, config, branch, live):
    """(successor, rule) by an `arm` rule: at a branch on a `branch_line`,
    the one live successor whose first block runs an `arm` line (whatever
    predicate or polarity the compiler chose); (None, None) otherwise."""
    for rule in config.preds:
        if "arm" not in rule or not _matches(source, branch, rule["branch_line"]):
            continue
        hits = [s for s in live
                if any(_matches(source, fn.instrs[i], rule["arm"]) for i in range(blocks[s].first, blocks[s].last + 1))]
        if len(hits) == 1:
            return hits[0], rule
    return None, None


def _arm_lines(fn, blocks, source, b):
    block = blocks[b]
    seen = []
    for i in range(block.first, block.last + 1):
        text = source.describe(fn.instrs[i])
        if text not in seen:
            seen.append(text)
    return "; ".join(seen[:3])


def walk(fn, blocks, block_at, source, config):
    """The instructions of one steady-state iteration, in order, repeated
    as executed (inner loops expanded). Of several copies of the loop, the
    first (widest) whose walk succeeds and runs every `require` pattern."""
    first_error = None
    for header, latch in find_loops(fn, blocks, block_at, source, config):
        try:
            path, loop, decisions = _walk_loop(fn, blocks, source, config, header, latch)
        except WalkError as e:
            first_error = first_error or e
            continue
        missing = [p.pattern for p in config.require if not any(_matches(source, i, p) for i in path)]
        if missing:
            first_error = first_error or WalkError("the loop at B%d runs no line matching %s" % (header, missing))
            continue
        return path, loop, decisions
    raise first_error


def _walk_loop(fn, blocks, source, config, header, latch):
    dead, pdom = _liveness(fn, blocks, header, latch, source, config)
    if dead[header]:
        raise WalkError("every path through the loop hits an excluded line")
    path, visit, decisions = [], {}, []
    prologue = fn.instrs[:blocks[header].first]
    b = header
    for _ in range(100000):
        block = blocks[b]
        visit[b] = len(path)
        path.extend(fn.instrs[block.first:block.last + 1])
        if b == latch:
            return path, (header, latch), decisions
        last = fn.instrs[block.last]
        back = [s for s in block.taken if header <= s <= b]
        if back:
            trips = [n for rule, n in config.trips if _trip_matches(source, prologue + path, last, rule)]
            if not trips:
                name = last.pred.lstrip("@!")
                setter = next((i for i in reversed(prologue + path) if name and _writes(i, name)), None)
                raise WalkError("inner loop %x..%x (%s; back edge on %s) has no trip count" % (
                    fn.instrs[blocks[back[0]].first].addr, last.addr, source.describe(last), setter))
            if trips[0] < 1:
                raise WalkError("inner loop at %x: trip count %d < 1; exclude it instead" % (last.addr, trips[0]))
            path.extend(path[visit[back[0]]:] * (trips[0] - 1))
            if block.fallthrough is None:
                raise WalkError("inner loop at %x has no exit by fall-through" % last.addr)
            b = block.fallthrough
            continue
        live = [s for s in block.succs if b < s <= latch and not dead[s]]
        if len(live) == 1:
            b = live[0]
            continue
        if not live:
            raise WalkError("no live successor after %x (%s)" % (last.addr, source.describe(last)))
        arm, rule = _choose_arm(fn, blocks, source, config, last, live)
        if arm is not None:
            decisions.append((last, rule))
            b = arm
            continue
        if last.base == "BRA" and len(block.taken) == 1 and block.fallthrough is not None:
            value, rule = _decide(source, config, prologue + path, last)
            if value is not None:
                b = block.taken[0] if value != last.pred.startswith("@!") else block.fallthrough
                if b not in live:
                    raise WalkError("rule %r sends the branch at %x into a dead arm" % (rule.get("why"), last.addr))
                decisions.append((last, rule))
                continue
        join = min(pdom[b] - {b}) if len(pdom[b]) > 1 else None
        guarded = [s for s in live if s != join]
        if len(live) == 2 and len(guarded) == 1:
            b = guarded[0]
            continue
        arms = " | ".join("B%d: %s" % (s, _arm_lines(fn, blocks, source, s)) for s in live)
        trace = prologue + path
        name = last.pred.lstrip("@!")
        setter = next((i for i in reversed(trace) if name and _writes(i, name)), None)
        define = None
        if setter is not None and len(_operands(setter)) > 2:
            reg = _operands(setter)[2]
            define = next((i for i in reversed(trace[:trace.index(setter)]) if _writes(i, reg)), None)
        raise WalkError("branch at %x (%s), predicate from %s (%s; operand from %s), has live arms: %s" % (
            last.addr, source.describe(last), setter, source.describe(setter) if setter else "-", define, arms))
    raise WalkError("walk did not reach the latch")


def class_counts(path):
    counts = {c: 0 for c in CLASSES}
    for instr in path:
        counts[instr_class(instr)] += 1
    return counts
