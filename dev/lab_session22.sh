#!/usr/bin/env bash
# Fifteenth session, fourth call. lab_session21.sh (H100): the bulk ring on the big projections at two blocks
# of 8 warps an SM +7.8 us a step against the product's register path (one block of 8: +110.9, of 20: +103.6),
# h100_ab_lab21.log. Around it: 3 blocks of 8, 2 of 10, 4 of 4, 2 of 8 with at most 6 slots (room for the
# next kernel), 2 of 8 on every GEMV; one process at 32K, the product twice. (Their correctness: the GEMV's
# bulk tests of lab_session21.sh; a bulk block's grid and slots change no sum.) Results under $OUT:
# ab.{log,json}. Say which card ran it. timeout_s 300.
LAB_DEFAULT_SECONDS=290
source dev/lab_prelude.sh
b="qkvfgb, q|kv_a|g, MLP"
default="bulk, 2 blocks of 8 warps: $b;bulk, 3 blocks of 8 warps: $b;bulk, 2 blocks of 10 warps: $b"
default+=";bulk, 4 blocks of 4 warps: $b;bulk, 2 blocks of 8 warps, at most 6 slots: $b;product again"
default+=";bulk, 2 blocks of 8 warps: every GEMV"
ab ab "product;${VARIANTS:-$default}" --deadline "${AB_DEADLINE:-170}"
