"""The stages: every capability of a run beyond capturing, each in its folder and registered
when imported here."""

from hookrun.stages import circuit as circuit
from hookrun.stages import derive as derive
from hookrun.stages import evaluate as evaluate
from hookrun.stages import features as features
from hookrun.stages import generate as generate
from hookrun.stages import graph as graph
from hookrun.stages import induction as induction
from hookrun.stages import lens as lens
from hookrun.stages import metrics as metrics
from hookrun.stages import patching as patching
from hookrun.stages import sae as sae
from hookrun.stages import sanity as sanity
from hookrun.stages import steering as steering
from hookrun.stages import train as train
