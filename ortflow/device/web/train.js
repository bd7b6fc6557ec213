// Trains an ortflow export with onnxruntime-web's training API: the set's checkpoint and its training, eval and
// optimizer models, on its example batch; each step's loss in the table and the curve; the trained parameters as
// a download (getContiguousParameters(false): every parameter, in manifest.json's "parameters" order, float32).
// URL parameters: set=FOLDER (the set, relative to this page; default ".."), steps=N, autorun (train at load),
// dump (write the parameters into the result as base64, for tests).
const query = new URLSearchParams(location.search);
const setUrl = new URL((query.get("set") || "..").replace(/\/?$/, "/"), location.href);
const $ = (id) => document.getElementById(id);
let session, feeds, manifest, trained;

async function bytes(path, base = setUrl) {
  const response = await fetch(new URL(path, base));
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return new Uint8Array(await response.arrayBuffer());
}

function tensor(spec, raw) {
  const arrays = { float32: Float32Array, int64: BigInt64Array, int32: Int32Array, bool: Uint8Array };
  const Type = arrays[spec.dtype];
  if (!Type) throw new Error(`input ${spec.name}: dtype ${spec.dtype} is not supported by this page`);
  return new ort.Tensor(spec.dtype, new Type(raw.buffer, raw.byteOffset, raw.byteLength / Type.BYTES_PER_ELEMENT),
                        spec.shape);
}

function scalar(result) {
  const value = Object.values(result)[0].data[0];
  return typeof value === "bigint" ? Number(value) : value;
}

function draw(losses) {
  const svg = $("curve"), w = 600, h = 220, pad = 30;
  const lo = Math.min(...losses), hi = Math.max(...losses), span = hi - lo || 1;
  const x = (i) => pad + (losses.length > 1 ? (i * (w - 2 * pad)) / (losses.length - 1) : 0);
  const y = (v) => h - pad - ((v - lo) * (h - 2 * pad)) / span;
  const points = losses.map((v, i) => `${x(i).toFixed(1)},${y(v).toFixed(1)}`).join(" ");
  svg.innerHTML = `<polyline fill="none" stroke="#1565c0" stroke-width="2" points="${points}"/>` +
    `<text x="${pad}" y="16" font-size="12">loss ${hi.toFixed(4)}</text>` +
    `<text x="${pad}" y="${h - 8}" font-size="12">${lo.toFixed(4)} after ${losses.length} steps</text>`;
}

function base64(u8) {
  let text = "";
  for (let i = 0; i < u8.length; i += 0x8000) text += String.fromCharCode.apply(null, u8.subarray(i, i + 0x8000));
  return btoa(text);
}

async function load() {
  ort.env.wasm.wasmPaths = new URL("ort/", location.href).href;
  manifest = JSON.parse(new TextDecoder().decode(await bytes("manifest.json")));
  const files = manifest.files;
  const example = new URL(manifest.example_batch.folder.replace(/\/?$/, "/"), setUrl);
  feeds = {};
  for (const spec of manifest.example_batch.inputs) feeds[spec.name] = tensor(spec, await bytes(spec.file, example));
  session = await ort.TrainingSession.create({
    checkpointState: await bytes(files.checkpoint),
    trainModel: await bytes(files.training_model),
    evalModel: await bytes(files.eval_model),
    optimizerModel: await bytes(files.optimizer_model),
  });
  $("about").textContent = `batch of ${manifest.batch_size}, ${manifest.parameters.count} parameters, ` +
    `learning rate ${manifest.learning_rate.value} (carried in the optimizer model), ` +
    `onnxruntime-web ${ort.env.versions.web}, ${crossOriginIsolated ? "threads" : "one thread (no COOP/COEP)"}`;
  $("status").textContent = "Ready.";
  $("train").disabled = false;
}

async function train(steps) {
  $("train").disabled = true;
  const losses = [], body = $("losses").tBodies[0];
  for (let step = 1; step <= steps; step++) {
    const loss = scalar(await session.runTrainStep(feeds));
    await session.runOptimizerStep();
    await session.lazyResetGrad();
    losses.push(loss);
    body.insertAdjacentHTML("beforeend", `<tr><td>${step}</td><td>${loss.toFixed(7)}</td></tr>`);
    draw(losses);
    $("status").textContent = `step ${step}/${steps}: loss ${loss.toFixed(6)}`;
  }
  const evalLoss = scalar(await session.runEvalStep(feeds));
  trained = await session.getContiguousParameters(false);
  $("download").disabled = false;
  $("train").disabled = false;
  $("status").textContent = `trained ${steps} steps; eval loss on the example batch ${evalLoss.toFixed(6)}`;
  const raw = new Uint8Array(trained.data.buffer, trained.data.byteOffset, trained.data.byteLength);
  const result = { status: "done", losses, evalLoss, parameterCount: trained.data.length,
                   crossOriginIsolated, onnxruntimeWeb: ort.env.versions.web };
  if (query.has("dump")) result.parameters = base64(raw);
  $("result").textContent = JSON.stringify(result);
}

$("train").onclick = () => train(Number($("steps").value)).catch(fail);
$("download").onclick = () => {
  const raw = new Uint8Array(trained.data.buffer, trained.data.byteOffset, trained.data.byteLength);
  const link = document.createElement("a");
  link.href = URL.createObjectURL(new Blob([raw], { type: "application/octet-stream" }));
  link.download = "parameters.bin";  // ortflow-import-artifacts parameters.bin RUN_DIR --set FOLDER
  link.click();
};

function fail(error) {
  $("status").textContent = `error: ${error.message || error}`;
  $("result").textContent = JSON.stringify({ status: "error", error: String(error.message || error) });
}

if (query.get("steps")) $("steps").value = query.get("steps");
load().then(() => (query.has("autorun") ? train(Number($("steps").value)) : null)).catch(fail);
