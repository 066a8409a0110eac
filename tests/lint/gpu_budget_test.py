#!/usr/bin/env python3
"""tools/gpu_budget without a GPU or the CUDA tools: the steady-state walk
over a small nvdisasm listing (branch rules, guarded code, inner loops,
excluded lines, slow paths), occupancy, and a ceiling that fails."""
import os
import pathlib
import sys
import tempfile
import unittest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "gpu_budget"))

import sass  # noqa: E402
import sass_budget  # noqa: E402
import steady_loop  # noqa: E402
import resources  # noqa: E402

SOURCE = """prologue();
for (int tile = 0; tile < end; tile += 16) {
  switch (bits) {
  if (tok < end) LoadRun(w);
  for (int i = 0; i < pairs; ++i) AddBack(i);
  SlowDivide();
"""

LISTING = """
\t.section\t.text.kern,"ax",@progbits
.text.kern:
\t//## File "{src}", line 1
        /*0000*/                   MOV R1, R2 ;
.L_x_0:
\t//## File "{src}", line 2
        /*0010*/                   LDG.E R4, desc[UR4][R2.64+0xc] ;
\t//## File "{src}", line 3
        /*0020*/                   ISETP.NE.AND P0, PT, R5, 0x3, PT ;
        /*0030*/              @!P0 BRA `(.L_x_1) ;
        /*0040*/                   IMAD R6, R6, R7, RZ ;
        /*0050*/                   BRA `(.L_x_2) ;
.L_x_1:
        /*0060*/                   HMMA.1688.F32.TF32 R8, R8, R10, R8 ;
.L_x_2:
\t//## File "{src}", line 4
        /*0070*/                   ISETP.GE.AND P1, PT, R11, R12, PT ;
        /*0080*/               @P1 BRA `(.L_x_3) ;
\t//## File "{src}", line 4 inlined at "{src}", line 4
        /*0090*/                   LDS R13, [R14] ;
.L_x_3:
\t//## File "{src}", line 6
        /*00a0*/                   ISETP.GT.AND P3, PT, R16, RZ, PT ;
        /*00b0*/               @P3 BRA `(.L_x_5) ;
        /*00c0*/                   CALL.REL.NOINC `($__internal_0_$__cuda_div_slowpath) ;
.L_x_5:
\t//## File "{src}", line 5
        /*00d0*/                   FFMA R1, R1, R1, R1 ;
        /*00e0*/                   ISETP.NE.AND P2, PT, R15, RZ, PT ;
        /*00f0*/               @P2 BRA `(.L_x_5) ;
\t//## File "{src}", line 2
        /*0100*/                   ISETP.LT.AND P0, PT, R1, R2, PT ;
        /*0110*/               @P0 BRA `(.L_x_0) ;
        /*0120*/                   EXIT ;
"""

# ptxas's unswitching: two copies of the token loop, the wider one with the
# add-back (line 3), the narrower without.
SOURCE_COPIES = """prologue();
for (int tile = 0; tile < end; tile += 16) {
  AddBack(tile);
  Body(tile);
"""

LISTING_COPIES = """
\t.section\t.text.two,"ax",@progbits
.text.two:
\t//## File "{src}", line 1
        /*0000*/                   ISETP.NE.AND P5, PT, R9, RZ, PT ;
        /*0010*/               @P5 BRA `(.L_x_20) ;
.L_x_10:
\t//## File "{src}", line 4
        /*0020*/                   HMMA.16816.F32 R8, R8, R10, R8 ;
\t//## File "{src}", line 2
        /*0030*/                   ISETP.LT.AND P0, PT, R1, R2, PT ;
        /*0040*/               @P0 BRA `(.L_x_10) ;
        /*0050*/                   EXIT ;
.L_x_20:
\t//## File "{src}", line 3
        /*0060*/                   FFMA R3, R3, R3, R3 ;
        /*0070*/                   FFMA R4, R4, R4, R4 ;
\t//## File "{src}", line 4
        /*0080*/                   HMMA.16816.F32 R8, R8, R10, R8 ;
\t//## File "{src}", line 2
        /*0090*/                   ISETP.LT.AND P0, PT, R1, R2, PT ;
        /*00a0*/               @P0 BRA `(.L_x_20) ;
        /*00b0*/                   EXIT ;
"""

PRED_BITS = {"why": "bits", "setter": r"^ISETP\.NE\.AND P\d, PT, R\d+, 0x3, PT$", "line": "switch", "value": "bits"}


class WalkTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        src = os.path.join(cls.tmp.name, "kernel.cuh")
        pathlib.Path(src).write_text(SOURCE)
        cls.fn = sass.parse(LISTING.format(src=src))["kern"]
        cls.blocks, cls.block_at = sass.blocks_of(cls.fn)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def walk(self, bits, trips=4, exclude=()):
        config = steady_loop.Config(r"for \(int tile = ", exclude, [(r"for \(int i = 0; i < pairs", "pairs")],
                                    [PRED_BITS], {"bits": bits, "pairs": trips})
        path, loop, _ = steady_loop.walk(self.fn, self.blocks, self.block_at, steady_loop.Source(), config)
        return [i.base for i in path]

    def test_rules_guards_and_inner_loops(self):
        # 3 (loop head) + HMMA (bits == 3) + 2 + the guarded LDS + 2 (the
        # slow path's CALL skipped) + 3 x 4 (inner loop) + 2 (latch).
        path = self.walk(3)
        self.assertEqual(len(path), 23)
        self.assertEqual(path.count("HMMA"), 1)
        self.assertEqual(path.count("LDS"), 1)
        self.assertEqual(path.count("FFMA"), 4)
        self.assertNotIn("CALL", path)

    def test_other_width_takes_the_other_case(self):
        path = self.walk(4)
        self.assertEqual(path.count("HMMA"), 0)
        self.assertEqual(path.count("IMAD"), 1)
        self.assertEqual(len(path), 24)

    def test_excluded_line(self):
        self.assertEqual(self.walk(3, exclude=[r"LoadRun\("]).count("LDS"), 0)

    def test_trip_count_by_the_closing_compare(self):
        trip = {"line": "for", "setter": r"^ISETP\.NE\.AND P\d, PT, R15, RZ, PT$", "count": 2}
        config = steady_loop.Config(r"for \(int tile = ", (), [trip], [PRED_BITS], {"bits": 3})
        path, _, _ = steady_loop.walk(self.fn, self.blocks, self.block_at, steady_loop.Source(), config)
        self.assertEqual([i.base for i in path].count("FFMA"), 2)

    def test_unknown_trip_count_stops(self):
        config = steady_loop.Config(r"for \(int tile = ", (), (), [PRED_BITS], {"bits": 3})
        with self.assertRaisesRegex(steady_loop.WalkError, "no trip count"):
            steady_loop.walk(self.fn, self.blocks, self.block_at, steady_loop.Source(), config)

    def test_unresolved_two_armed_branch_stops(self):
        config = steady_loop.Config(r"for \(int tile = ", (), [(r"pairs", 4)])
        with self.assertRaisesRegex(steady_loop.WalkError, "live arms"):
            steady_loop.walk(self.fn, self.blocks, self.block_at, steady_loop.Source(), config)

    def test_ceiling_fails(self):
        kernel = sass_budget.Kernel("kern", "Kern<128>", "k.cu.o")
        kernel.function = self.fn
        kind = {"loop": r"for \(int tile = ", "pred": [PRED_BITS], "trips": [[r"pairs", "pairs"]]}
        budgets = {"kind": {"k": kind}, "instance": [
            {"preset": "ok", "kernel": "Kern<128>", "kind": "k", "values": {"bits": 3, "pairs": 4}, "tokens": 2,
             "target": 5, "ceiling": 11.5},
            {"preset": "over", "kernel": "Kern<128>", "kind": "k", "values": {"bits": 3, "pairs": 4}, "tokens": 2,
             "ceiling": 11.4}]}
        _, rows, problems = sass_budget.loop_rows({"kern": kernel}, budgets)
        self.assertEqual([r[2] for r in rows], ["11.5", "11.5"])  # 23 instructions / 2 tokens
        self.assertEqual(rows[0][-1], "ok (2.3x target)")
        self.assertEqual(rows[1][-1], "OVER CEILING")
        self.assertEqual(len(problems), 1)
        self.assertIn("over", problems[0])


class LoopCopiesTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        src = os.path.join(self.tmp.name, "kernel.cuh")
        pathlib.Path(src).write_text(SOURCE_COPIES)
        self.fn = sass.parse(LISTING_COPIES.format(src=src))["two"]
        self.blocks, self.block_at = sass.blocks_of(self.fn)

    def tearDown(self):
        self.tmp.cleanup()

    def walk(self, exclude=(), require=()):
        config = steady_loop.Config(r"for \(int tile = ", exclude, require=require)
        path, _, _ = steady_loop.walk(self.fn, self.blocks, self.block_at, steady_loop.Source(), config)
        return [i.base for i in path]

    def test_both_copies_are_found(self):
        loops = steady_loop.find_loops(self.fn, self.blocks, self.block_at, steady_loop.Source(),
                                       steady_loop.Config(r"for \(int tile = "))
        self.assertEqual(len(loops), 2)

    def test_an_excluded_line_picks_the_copy_without_it(self):
        self.assertEqual(self.walk(exclude=[r"AddBack\("]), ["HMMA", "ISETP", "BRA"])

    def test_a_kept_line_picks_the_copy_that_runs_it(self):
        self.assertEqual(self.walk(require=[r"AddBack\("]), ["FFMA", "FFMA", "HMMA", "ISETP", "BRA"])

    def test_a_kept_line_no_copy_runs_stops(self):
        with self.assertRaisesRegex(steady_loop.WalkError, "runs no line matching"):
            self.walk(require=[r"Missing\("])


class OccupancyTest(unittest.TestCase):
    def test_sm90(self):
        # 168 registers: 5376 per warp, 12 warps of 64K: 3 blocks of 4 warps.
        self.assertEqual(resources.occupancy(168, 3584, 128), (3, 12 / 64, "registers"))
        # 32 registers, 128 threads: 16 blocks by threads (2048).
        self.assertEqual(resources.occupancy(32, 0, 128)[0], 16)
        # 100 KiB of shared memory: 2 blocks.
        self.assertEqual(resources.occupancy(32, 100 * 1024, 128)[:1], (2,))


if __name__ == "__main__":
    unittest.main()
