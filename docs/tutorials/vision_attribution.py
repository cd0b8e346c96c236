"""Tutorial 1: attribute a classifier's decisions with Grad-CAM, then measure the maps.

Runs the shipped digits CNN on eight of scikit-learn's handwritten digits (8 x 8 pixels, so it
takes seconds on a laptop), makes a Grad-CAM map per image and scores every map with the
faithfulness metrics: deletion, insertion and ROAD.
"""

import hookrun

result = hookrun.run(
    [
        "experiment=grad_cam",
        "model=digits_cnn",
        "dataset=digits",
        "limit=8",
        "evaluate=faithfulness",
        "render=false",
    ],
    run_dir="outputs/vision",
)
print(result.summary)

with result.open() as res:
    print(res)  # every dataset by the key that opens it, with its shape
    cams = res["derived/grad_cam/features"][:]  # (8, h, w): one raw map per image
    deletion = res["evaluate/deletion/derived/grad_cam/features.auc"][:]  # (8,): lower is better
    road = res["evaluate/road/derived/grad_cam/features.score"][:]  # (8,): higher is better
    print("maps", cams.shape, "deletion AUC", deletion.mean(), "ROAD", road.mean())
