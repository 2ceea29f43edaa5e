"""A PD cluster simulator in virtual time that routes with the router's own policy objects; beside it the request
traces it runs (``traces.py``) and the sampler of real servers' rank balance whose figures it is compared with and
fitted to (``balance_sampling.py``)."""
