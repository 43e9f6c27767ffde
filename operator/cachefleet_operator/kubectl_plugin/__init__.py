"""``kubectl cachefleet``: the kubectl plugin (installed as the executable ``kubectl-cachefleet``).

* :mod:`.views` and :mod:`.explain` are pure: objects, heartbeats and
  request bodies in, the text and documents a user sees out;
* :mod:`.cluster` is the adapter: kubeconfig, the Kubernetes API, Redis;
* :mod:`.cli` parses the command line and wires the two together.
"""
