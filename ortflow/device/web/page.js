// The page: trains the set on the person's own text file or folder of images (or, with nothing picked, the set's
// example batch), plots the loss live, evaluates on a held-out part, shows what the model learned (a continuation
// of a prompt, labels for images) and offers the trained parameters for ortflow-import-artifacts. Built on
// ortflow-device.js. Nothing leaves the page: it fetches only from its own server (the set, onnxruntime-web, and
// the data a URL parameter names there) and sends nothing; the parameters leave through the Download button alone.
// URL parameters (for a page opened with data served beside it, and for scripts), same-origin only:
//   set=FOLDER (the set, relative to this page; default "..")   data=FILE or data=FOLDER/ (served beside the page)
//   steps=N   seed=N   prompt=TEXT   tokens=N   temperature=T   autorun (train at load)   dump (parameters in the result)
// The result (JSON) is written into the page's hidden #result element when done or failed: a script driving the
// page reads it there.
import { DataError, openSet, scalar } from "./ortflow-device.js";

const query = new URLSearchParams(location.search);
const $ = (id) => document.getElementById(id);
const seed = Number(query.get("seed") || 0);
let set, data = null, example = null, trained = null, lastRun = {};

function status(text, error = false) {
  $("status").textContent = text;
  $("status").className = error ? "error" : "";
}

function fail(error) {
  const message = error instanceof DataError ? error.message : `error: ${error.message || error}`;
  if (!(error instanceof DataError)) console.error(error.stack || error);
  status(message, true);
  show({ status: "error", error: String(error.message || error), kind: error instanceof DataError ? "data" : "internal" });
  $("train").disabled = !set;
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

/** A URL parameter's URL, refused unless it is on the page's own server: the page fetches nothing elsewhere. */
function ownUrl(name, spec) {
  const url = new URL(spec, location.href);
  if (url.origin !== location.origin) {
    throw new DataError(`${name}=${spec} is on another server (${url.origin}): the page reads only what its own ` +
      `server (${location.origin}) serves, so that nothing you train leaves it. Serve the file from there.`);
  }
  return url;
}

function base64(u8) {
  let text = "";
  for (let i = 0; i < u8.length; i += 0x8000) text += String.fromCharCode.apply(null, u8.subarray(i, i + 0x8000));
  return btoa(text);
}

function escape(text) {
  return text.replace(/[&<>]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;" })[c]);
}

// ---- data: picked by the person, or named by the URL --------------------------------------------------------------

async function useText(bytes, name) {
  data = set.textData(bytes);
  const held = data.heldOut;
  $("data-about").textContent = `${name}: ${held.tokens} tokens; training on the first ${held.fromToken}, ` +
    `${held.windows} windows of ${set.prep.block_size} held out to evaluate.`;
  if (!$("prompt").value) {  // the held-out text's start
    const tokens = set.encode(bytes);
    $("prompt").value = set.decode(tokens.subarray(held.fromToken, held.fromToken + 8));
  }
}

const UNREADABLE = "not an image the browser can read";

/** Files of a picked or served folder ([{path, ...}], paths relative to it) with their labels: one rule for both
 * ways in. A file's label is the folder it is in directly under the picked one; hidden files (a name starting
 * with a dot) are ignored; files beside the label folders are left out, with the reason. */
function labelled(entries) {
  const files = [], leftOut = [];
  for (const entry of entries) {
    const parts = entry.path.split("/");
    if (parts.some((part) => part.startsWith("."))) continue;
    if (parts.length < 2) leftOut.push({ name: entry.path, why: "beside the label folders, in none" });
    else files.push({ ...entry, label: parts[0], name: entry.path });
  }
  return { files, leftOut };
}

function named(leftOut) {
  const shown = leftOut.slice(0, 5).map((f) => `${f.name} (${f.why})`).join(", ");
  return `${leftOut.length} left out: ${shown}${leftOut.length > 5 ? `, and ${leftOut.length - 5} more` : ""}`;
}

async function useImages(files, name, leftOut = []) {
  status(`reading ${files.length} images...`);
  data = await set.imageData(files);
  data.skipped = [...leftOut, ...data.skipped.map((file) => ({ name: file, why: UNREADABLE }))];
  const notes = [];
  if (data.resized) notes.push(`${data.resized} resized from other sizes to ${set.prep.image_size}x${set.prep.image_size}`);
  if (data.skipped.length) notes.push(named(data.skipped));
  $("data-about").textContent = `${name}: ${data.train.length} images to train on, ${data.eval.length} held out; ` +
    `labels ${data.classNames.join(", ")}${notes.length ? `; ${notes.join("; ")}` : ""}.`;
}

async function fromUrl(spec) {
  const url = ownUrl("data", spec);
  if (!spec.endsWith("/")) {
    const response = await fetch(url);
    if (!response.ok) throw new DataError(`data=${spec} could not be loaded (HTTP ${response.status}).`);
    return useText(new Uint8Array(await response.arrayBuffer()), spec);
  }
  const listing = await fetch(new URL("?list", url));  // serve.py lists a folder in its data folder as JSON
  if (!listing.ok) {
    throw new DataError(`data=${spec}: the folder cannot be listed (HTTP ${listing.status}); serve.py lists only ` +
      "the folders in the export folder's data/.");
  }
  const { files, leftOut } = labelled((await listing.json()).map((path) => ({ path })));
  const loaded = [];
  for (const file of files) {
    const response = await fetch(new URL(file.path, url)).catch((error) => ({ ok: false, status: error.message }));
    if (response.ok) loaded.push({ ...file, blob: await response.blob() });
    else leftOut.push({ name: file.name, why: `could not be loaded: HTTP ${response.status}` });
  }
  return useImages(loaded, spec, leftOut);
}

$("text-file").onchange = async (event) => {
  const file = event.target.files[0];
  if (file) await useText(new Uint8Array(await file.arrayBuffer()), file.name).then(() => status("Ready.")).catch(fail);
};
$("image-folder").onchange = async (event) => {
  const picked = [...event.target.files];  // webkitRelativePath: the picked folder's name, then the path in it
  const entries = picked.map((f) => ({ path: f.webkitRelativePath.split("/").slice(1).join("/"), blob: f }));
  const { files, leftOut } = labelled(entries);
  const folder = picked.length ? picked[0].webkitRelativePath.split("/")[0] : "the folder";
  await useImages(files, folder, leftOut).then(() => status("Ready.")).catch(fail);
};

// ---- training, evaluation, what it learned ------------------------------------------------------------------------

async function train(steps) {
  $("train").disabled = true;
  const losses = [], body = $("losses").tBodies[0];
  body.innerHTML = "";
  const batches = data ? set.trainingBatches(data.train, { seed }) : null;
  for (let step = 1; step <= steps; step++) {
    const loss = await set.trainStep(batches ? batches.next().value : example);
    losses.push(loss);
    body.insertAdjacentHTML("beforeend", `<tr><td>${step}</td><td>${loss.toFixed(7)}</td></tr>`);
    draw(losses);
    status(`step ${step}/${steps}: loss ${loss.toFixed(6)}`);
    if (step % 10 === 0) await new Promise((r) => setTimeout(r));  // let the page draw
  }
  lastRun = { status: "done", mode: data ? set.kind : "example", losses };
  if (data) {
    const result = await set.evaluate(data.eval);
    lastRun.eval = result;
    lastRun.evalLoss = result.loss;
    lastRun.heldOut = data.heldOut;
    if (data.labels) {
      Object.assign(lastRun, { labels: data.labels, skipped: data.skipped.map((f) => f.name), resized: data.resized });
    }
    $("evaluation").textContent = `held out (${result.count} ${set.kind === "text" ? "tokens" : "images"}): loss ` +
      `${result.loss.toFixed(5)}` + (result.accuracy === null ? "" : `, accuracy ${(100 * result.accuracy).toFixed(1)}%`);
  } else {
    lastRun.evalLoss = scalar(await set.session.runEvalStep(example));
    $("evaluation").textContent = `eval loss on the example batch ${lastRun.evalLoss.toFixed(6)}`;
  }
  trained = await set.parameters();
  status(`trained ${steps} steps.`);
  $("download").disabled = $("train").disabled = false;
  $("continue").disabled = $("classify-files").disabled = false;
  if (data && set.kind === "text") await continuePrompt();
  if (data && set.kind === "image") await classify(data.eval.map((s) => ({ name: s.name, blob: s.blob, truth: s.label })));
  publish();
}

async function continuePrompt() {
  const prompt = $("prompt").value;
  status("continuing the prompt...");
  const text = await set.continueText(prompt, { tokens: Number(query.get("tokens") || 120), seed,
                                                temperature: Number($("temperature").value) });
  $("continuation").innerHTML = `<b>${escape(prompt)}</b>${escape(text)}`;
  lastRun.prompt = prompt;
  lastRun.continuation = text;
  status("Ready.");
}

async function classify(items) {
  const found = await set.classify(items.map((i) => i.blob), data && data.labels);  // null: an unreadable file
  const body = $("predictions").tBodies[0];
  body.innerHTML = "";
  lastRun.predictions = items.map((item, k) => ({ name: item.name, truth: item.truth ?? null,
                                                  label: found[k] && found[k].label,
                                                  probability: found[k] && found[k].probability }));
  const leftOut = lastRun.predictions.filter((p) => p.label === null).map((p) => ({ name: p.name, why: UNREADABLE }));
  lastRun.unlabelled = leftOut.map((f) => f.name);
  $("classify-about").textContent = leftOut.length ? `${named(leftOut)}.` : "";
  lastRun.predictions.forEach((p, k) => {
    if (p.label === null) {
      body.insertAdjacentHTML("beforeend", `<tr><td></td><td>${escape(p.name)}</td><td>${UNREADABLE}: left out</td>` +
        "<td></td></tr>");
      return;
    }
    const image = URL.createObjectURL(items[k].blob);
    body.insertAdjacentHTML("beforeend", `<tr><td><img src="${image}" alt="${escape(p.name)}"></td>` +
      `<td>${escape(p.name)}</td><td><b>${escape(p.label)}</b> ${(100 * p.probability).toFixed(0)}%</td>` +
      `<td class="muted">${p.truth === null ? "" : `(labelled ${escape(p.truth)})`}</td></tr>`);
  });
}

function publish() {
  const result = { ...lastRun, parameterCount: trained.length / 4, crossOriginIsolated,
                   onnxruntimeWeb: ort.env.versions.web };
  if (query.has("dump")) result.parameters = base64(trained);
  show(result);
}

function show(result) {  // in the page, for a script driving it: nothing is sent anywhere
  $("result").textContent = JSON.stringify(result);
}

$("train").onclick = () => train(Number($("steps").value)).catch(fail);
$("continue").onclick = () => continuePrompt().then(publish).catch(fail);
$("classify-files").onchange = (event) =>
  classify([...event.target.files].map((f) => ({ name: f.name, blob: f }))).then(publish).catch(fail);
$("download").onclick = () => {
  const link = document.createElement("a");
  link.href = URL.createObjectURL(new Blob([trained], { type: "application/octet-stream" }));
  link.download = "parameters.bin";  // ortflow-import-artifacts parameters.bin RUN_DIR --set FOLDER
  link.click();
};

async function load() {
  ort.env.wasm.wasmPaths = new URL("ort/", location.href).href;
  set = await openSet(ownUrl("set", query.get("set") || "..").href);
  const m = set.manifest;
  $("about").textContent = `${set.kind || "custom"} set: batch of ${m.batch_size}, ${m.parameters.count} parameters, ` +
    `learning rate ${m.learning_rate.value} (carried in the optimizer model), onnxruntime-web ${ort.env.versions.web}, ` +
    `${crossOriginIsolated ? "threads" : "one thread (no COOP/COEP)"}`;
  if (set.kind === "text") ["pick-text", "try-text"].forEach((id) => $(id).classList.remove("hidden"));
  if (set.kind === "image") ["pick-images", "try-images"].forEach((id) => $(id).classList.remove("hidden"));
  example = await set.exampleBatch();
  if (query.get("prompt") !== null) $("prompt").value = query.get("prompt");
  if (query.get("temperature") !== null) $("temperature").value = query.get("temperature");
  if (query.get("data")) await fromUrl(query.get("data"));
  status("Ready.");
  $("train").disabled = false;
}

if (query.get("steps")) $("steps").value = query.get("steps");
load().then(() => (query.has("autorun") ? train(Number($("steps").value)) : null)).catch(fail);
