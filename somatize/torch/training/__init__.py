"""Training: the Trainer, the Learning hole and what answers it, the cut a Learning or a host
makes in a graph, federated averaging, and the parameters an optimizer is handed."""
