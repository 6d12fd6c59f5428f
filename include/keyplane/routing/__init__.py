"""The routing configuration: what places each key of each stage on an instance.

Its versioned, checksummed model and store (:mod:`~keyplane.routing.config`),
how a key becomes the routed key Spark groups by (:mod:`~keyplane.routing.routedkeys`:
change the routed-key hash there), and how one version becomes the next
(moves, hand-offs, waves).
"""
