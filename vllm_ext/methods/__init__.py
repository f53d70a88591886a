"""The methods, one package each (:mod:`vllm_ext.methods.protocol`: what the backend asks of them;
:mod:`vllm_ext.methods.registry`: which there are)."""
