"""The control plane: the reconfiguration protocol between the controller and the job.

The protocol's state machines (paper 000 §3.4), its signed messages, the
controller that rolls a version out stage by stage, and the quarantine of
records that fail a stage.
"""
