"""bench/triton_sm90.py without a compile: every device-dependent launch choice is answered as on a GPU, and a
kernel's registers and spills are read from its entry in ptxas's log. The compile for sm_90 itself:
tests/e2e/bench/test_triton_sm90.py."""


def test_every_device_dependent_launch_choice_is_answered_as_on_a_gpu():
    """A fusion helper that chooses by device type and that the script does not answer as a CUDA device would give
    the kernels the interpreter's tiles: the script refuses to run then; here it finds none."""
    from bench import triton_sm90
    assert triton_sm90.unanswered_device_choices(triton_sm90.gpu_choices(90)) == []


def test_ptxas_log_figures_are_those_of_the_kernel_entry():
    log = ("ptxas info    : 0 bytes gmem\n"
           "ptxas info    : Compiling entry function 'other' for 'sm_90a'\n"
           "ptxas info    : Function properties for other\n"
           "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
           "ptxas info    : Used 12 registers, used 0 barriers, 384 bytes cmem[0]\n"
           "ptxas info    : Compiling entry function '_attention_backward_kv' for 'sm_90a'\n"
           "ptxas info    : Function properties for _attention_backward_kv\n"
           "    416 bytes stack frame, 428 bytes spill stores, 420 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 1 barriers, 416 bytes cumulative stack size, 512 bytes cmem[0]\n")
    from bench import triton_sm90
    assert triton_sm90.parse_ptxas_log(log, "_attention_backward_kv") == dict(regs=255, stack=416, spill_stores=428,
                                                                              spill_loads=420)
