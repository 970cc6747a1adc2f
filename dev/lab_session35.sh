#!/usr/bin/env bash
# Nineteenth session, sixth lab: lab35 (dev/lab_session34.sh) found the shared gate_up on the 4 SMs the MoE kernel
# leaves free about 20 us a layer slower on the register path (8 or 4 blocks: a block's loads in flight bound its
# stream). Here the free SMs' blocks stream through bulk rings (5 task slots, about 200 KB in flight an SM), one
# process at 32K; the outputs are checked against the product's bit for bit. Results under $OUT: ab.{log,json}.
# timeout_s 240.
LAB_DEFAULT_SECONDS=225
source dev/lab_prelude.sh
f="MoE on 4 SMs fewer, shared gate_up late wait through rings on"
ab ab "product;$f 4 blocks;$f 8 blocks;$f 4 blocks of 20 warps;MoE on 4 SMs fewer;product again" --deadline 100
