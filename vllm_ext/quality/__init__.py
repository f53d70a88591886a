"""Quality harness: RULER-style synthetic long-context retrieval tasks (:mod:`vllm_ext.quality.tasks`)
for the purpose-built model in ``models/retrieval-llama`` and for any Hugging Face tokenizer, and an
offline probe of SFI's selection on them (:mod:`vllm_ext.quality.selection_probe`).

Imports neither vLLM nor torch. The evaluation through vLLM is ``scripts/eval_quality.py``; results
and the command that produced them are in ``bench/QUALITY.md``.
"""

from vllm_ext.quality.tasks import (TASKS, VOCAB, Sample, exact_match, make_sample, make_suite,
                                    make_text_sample, text_score, training_document)

__all__ = ["TASKS", "VOCAB", "Sample", "exact_match", "make_sample", "make_suite", "make_text_sample",
           "text_score", "training_document"]
