"""What palaestra adds to each vLLM worker (vLLM's ``worker_extension_cls``): loading weights
handed over as tensors. vLLM imports this module in its workers, where its methods run with
the worker as ``self``; it imports nothing of vLLM's."""

from __future__ import annotations

import torch

from palaestra.engine.attest import held_digests


class WeightLoader:
    def palaestra_load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Load ``(Hugging Face name, tensor)`` pairs with the worker's own in-place reload
        (which maps the names onto vLLM's fused layers and redoes what vLLM did to each layer
        after loading it), then refresh an output head tied to the embeddings."""
        self.reload_weights(weights_iterator=named, is_checkpoint_format=True)
        refresh_tied_heads(self.model_runner.get_model())

    def palaestra_digests(self, sent: dict[str, tuple], version: int) -> dict[str, tuple[str, str]]:
        """Digests of a few parameters among ``sent`` (name -> shape) that the model holds under
        that name and shape, picked by ``version``, for attesting a sync (``engine.attest``)."""
        model = self.model_runner.get_model()
        return held_digests(dict(model.named_parameters()), sent, version)


def refresh_tied_heads(model: torch.nn.Module) -> int:
    """Redo the post-load step of each output head that shares its weight with an embedding.

    vLLM's reload processes the layers whose parameters it loaded. A tied head loads none of
    its own, so what its method derived from the weight at load time stays stale: on the CPU
    build, a packed copy for its matmul, which left the logits on the old embeddings (seen:
    0.25 nats of log-prob gap after an embedding update, against 1e-5 for any other layer).
    Returns how many heads it refreshed."""
    embeddings = {
        id(module.weight)
        for module in model.modules()
        if isinstance(module, torch.nn.Module)
        and type(module).__name__ == "VocabParallelEmbedding"
        and isinstance(getattr(module, "weight", None), torch.Tensor)
    }
    refreshed = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        weight = getattr(module, "weight", None)
        if type(module).__name__ == "ParallelLMHead" and id(weight) in embeddings and method:
            method.process_weights_after_loading(module)
            refreshed += 1
    return refreshed
