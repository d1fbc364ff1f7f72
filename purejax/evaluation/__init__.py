"""How good a model is, by benchmarks: log-likelihood tasks from local files.

    from purejax import evaluation
    task = evaluation.load_task("arc_easy.jsonl", num_fewshot=5)
    results = evaluation.evaluate(params, config, tokenizer, [task])
    print(evaluation.table(results))

`loglik` scores continuations, many per compiled call; `tasks` reads
multiple-choice, schema and language-modelling tasks in DCLM's CORE formats
and scores them; `suite` runs several and reports them.
`python -m purejax.eval` is the command line.
"""

from purejax.evaluation import during_training
from purejax.evaluation import humaneval
from purejax.evaluation import loglik
from purejax.evaluation import rewards
from purejax.evaluation import sandbox
from purejax.evaluation import suite
from purejax.evaluation import tasks
from purejax.evaluation.during_training import task_metric
from purejax.evaluation.suite import evaluate
from purejax.evaluation.suite import table
from purejax.evaluation.tasks import load_task
from purejax.evaluation.tasks import Task
from purejax.evaluation.tasks import TaskError
