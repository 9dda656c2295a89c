// UfsNet: the network class for our general MLP in SOCA's two-file form
// (python -m toolkit.export torchscript RUN_DIR --out DIR/MODEL.pt --format ufsnet: DIR/MODEL.pt and
// DIR/normalization.MODEL.pt; toolkit/export/soca.py). SOCA as published runs IceNet (icenet.h; --format soca
// writes its files); UfsNet is the class SOCA would have to adopt to run our deeper MLP.
//
// It has the interface of SOCA's IceNet (JCSDA soca MLBalance, IceNet.h), so SOCA's BaseEmul<Net> (BaseEmul.h)
// could hold it in IceNet's place and load a trained emulator as it loads IceNet:
//
//   model_ = std::make_shared<Net>(inputSize_, hiddenSize_, outputSize_, kernelSize_, stride_);   // BaseEmul.h
//   model_->initWeights();
//   torch::load(model_, modelFileName);   // the layers fc1, fc2, ... and the buffers, by name
//   model_->loadNorm(modelFileName);      // <dir>/normalization.<file>: {input mean, input std, ...}
//
// and MLJac.h / IceEmul.h call forward(x) and jac(x) on one point (x [inputs], float32): forward returns the
// outputs in physical units, jac d output / d x in physical units ([inputs] for one output, as IceNet.h's jac).
// Where IceNet is fc1 -> fc2 -> sigmoid, UfsNet is our MLP: fc1 ... fc<L+1> with the archive's activation between
// (GELU, exact or the archive's gelu_approximate; ReLU; or none: "identity"; files without it: GELU), the output either de-normalised (output_mean, output_std) or, when the archive's
// output_activation is "sigmoid", sigmoid(network) as IceNet's. The depth and widths follow the archive that
// torch::load reads (load() below), so BaseEmul's five constructor arguments suffice. Statistics are float64, as in
// the Python model: inputs are normalised in float64 and cast to the network's dtype (float32), outputs come back
// float64. Batches [n, inputs] work too (jac then returns [n, outputs, inputs]). For inference: BaseEmul::train
// (float32 targets against float64 outputs) is not its use.
#pragma once

#include <torch/torch.h>

#include <filesystem>
#include <string>
#include <utility>
#include <vector>

struct UfsNet : torch::nn::Module {
  // BaseEmul.h's arguments (kernelSize and stride unused, as by IceNet), and the number of hidden layers (the
  // recipe's default 3; torch::load adapts it to the file's)
  UfsNet(int inputSize, int hiddenSize, int outputSize, int /*kernelSize*/ = 1, int /*stride*/ = 1,
         int hiddenLayers = 3) {
    std::vector<std::pair<int64_t, int64_t>> shapes;  // (in, out) of each Linear
    int64_t width = inputSize;
    for (int layer = 0; layer < hiddenLayers; ++layer) {
      shapes.emplace_back(width, hiddenSize);
      width = hiddenSize;
    }
    shapes.emplace_back(width, outputSize);
    build(shapes);
    // IceNet.h registers input_mean and input_std; ours are float64 and the outputs have theirs too
    inputMean = register_buffer("input_mean", torch::zeros({inputSize}, torch::kFloat64));
    inputStd = register_buffer("input_std", torch::ones({inputSize}, torch::kFloat64));
    outputMean = register_buffer("output_mean", torch::zeros({outputSize}, torch::kFloat64));
    outputStd = register_buffer("output_std", torch::ones({outputSize}, torch::kFloat64));
  }

  // torch::load(model, file) calls this: read the archive's string attributes and layer shapes, rebuild the layers
  // when they differ from the constructed ones, then read every parameter and buffer by name (nn::Module::load).
  void load(torch::serialize::InputArchive& archive) override {
    c10::IValue value;
    if (archive.try_read("output_activation", value)) sigmoid = value.toStringRef() == "sigmoid";
    if (archive.try_read("gelu_approximate", value)) geluApproximate = value.toStringRef();
    if (archive.try_read("activation", value)) activation = value.toStringRef();  // files without it: gelu
    TORCH_CHECK(activation == "gelu" || activation == "relu" || activation == "identity", "activation '", activation,
                "' is not gelu, relu or identity");
    std::vector<std::pair<int64_t, int64_t>> shapes;
    for (size_t index = 1;; ++index) {
      torch::serialize::InputArchive layer;
      if (!archive.try_read("fc" + std::to_string(index), layer)) break;
      torch::Tensor weight;
      layer.read("weight", weight);
      shapes.emplace_back(weight.size(1), weight.size(0));
    }
    if (!shapes.empty() && shapes != layerShapes()) {
      for (size_t index = 1; index <= fc.size(); ++index) unregister_module("fc" + std::to_string(index));
      build(shapes);
    }
    torch::nn::Module::load(archive);
  }

  // IceNet.h initNorm(mean, std): the inputs' statistics
  void initNorm(torch::Tensor mean, torch::Tensor stdDev) {
    torch::NoGradGuard noGrad;
    inputMean.set_(mean.to(torch::kFloat64).clone());
    inputStd.set_(stdDev.to(torch::kFloat64).clone());
  }

  // IceNet.h saveNorm/loadNorm: <dir of the model file>/normalization.<model file name>, a std::vector<Tensor>
  // {input mean, input std} (SOCA's order), then {output mean, output std} (ours; IceNet reads the first two).
  static std::string normFileName(const std::string& modelFileName) {
    std::filesystem::path filePath(modelFileName);
    return (filePath.parent_path() / ("normalization." + filePath.filename().string())).string();
  }

  void saveNorm(const std::string& modelFileName) {
    std::vector<torch::Tensor> moments = {inputMean, inputStd, outputMean, outputStd};
    torch::save(moments, normFileName(modelFileName));
  }

  void loadNorm(const std::string& modelFileName) {
    std::vector<torch::Tensor> moments;
    torch::load(moments, normFileName(modelFileName));
    TORCH_CHECK(moments.size() >= 2, normFileName(modelFileName), " holds ", moments.size(),
                " tensors; it needs the input mean and std");
    torch::NoGradGuard noGrad;
    inputMean.set_(moments[0].to(torch::kFloat64));
    inputStd.set_(moments[1].to(torch::kFloat64));
    if (moments.size() >= 4) {
      outputMean.set_(moments[2].to(torch::kFloat64));
      outputStd.set_(moments[3].to(torch::kFloat64));
    }
  }

  // IceNet.h initWeights: Xavier normal (and zero biases, as the Python model)
  void initWeights() {
    for (auto& layer : fc) {
      torch::nn::init::xavier_normal_(layer->weight);
      torch::nn::init::zeros_(layer->bias);
    }
  }

  // physical inputs [inputs] or [n, inputs] -> normalised, in the network's dtype
  torch::Tensor normalise(const torch::Tensor& x) {
    return ((x.to(torch::kFloat64) - inputMean) / inputStd).to(fc.front()->weight.scalar_type());
  }

  // the network alone: normalised inputs -> its last Linear's output
  torch::Tensor network(torch::Tensor z) {
    for (size_t index = 0; index + 1 < fc.size(); ++index) {
      z = fc[index]->forward(z);
      if (activation == "gelu") z = torch::gelu(z, geluApproximate);
      else if (activation == "relu") z = torch::relu(z);  // identity: z as it is
    }
    return fc.back()->forward(z);
  }

  // normalised inputs -> normalised outputs (UfsEmulator.forward: what was trained)
  torch::Tensor normalisedOutputs(const torch::Tensor& z) {
    auto out = network(z);
    if (sigmoid) return ((torch::sigmoid(out).to(torch::kFloat64) - outputMean) / outputStd).to(out.scalar_type());
    return out;
  }

  // physical inputs -> physical outputs, float64 (UfsEmulator.predict)
  torch::Tensor forward(torch::Tensor x) {
    auto out = network(normalise(x));
    if (sigmoid) return torch::sigmoid(out).to(torch::kFloat64);
    return out.to(torch::kFloat64) * outputStd + outputMean;
  }

  // d outputs / d inputs in physical units, float64: [n, outputs, inputs] for x [n, inputs]; for one point x
  // [inputs], [outputs, inputs], or [inputs] when there is one output (IceNet.h's jac). As UfsEmulator.jacobian:
  // autograd of the normalised outputs by the normalised inputs, one backward per output, times output_std /
  // input_std. Grad mode is switched on here (callers may hold a NoGradGuard).
  torch::Tensor jac(torch::Tensor x) {
    const bool onePoint = x.dim() == 1;
    torch::AutoGradMode enableGrad(true);
    auto z = normalise(onePoint ? x.unsqueeze(0) : x).detach().requires_grad_(true);
    auto y = normalisedOutputs(z);
    std::vector<torch::Tensor> rows;
    for (int64_t output = 0; output < y.size(1); ++output)
      rows.push_back(torch::autograd::grad({y.select(1, output).sum()}, {z}, {}, /*retain_graph=*/true)[0]);
    auto jacobian = torch::stack(rows, 1).to(torch::kFloat64) * outputStd.view({1, -1, 1}) / inputStd.view({1, 1, -1});
    if (!onePoint) return jacobian;
    jacobian = jacobian.squeeze(0);
    return jacobian.size(0) == 1 ? jacobian.squeeze(0) : jacobian;
  }

  std::vector<std::pair<int64_t, int64_t>> layerShapes() const {
    std::vector<std::pair<int64_t, int64_t>> shapes;
    for (const auto& layer : fc) shapes.emplace_back(layer->options.in_features(), layer->options.out_features());
    return shapes;
  }

  std::vector<torch::nn::Linear> fc;  // fc1, fc2, ... as registered (IceNet.h: fc1, fc2)
  torch::Tensor inputMean, inputStd, outputMean, outputStd;
  bool sigmoid = false;
  std::string geluApproximate = "none";
  std::string activation = "gelu";  // between the layers: the archive's activation (gelu, relu or identity)

 private:
  void build(const std::vector<std::pair<int64_t, int64_t>>& shapes) {
    fc.clear();
    for (size_t index = 0; index < shapes.size(); ++index)
      fc.push_back(register_module("fc" + std::to_string(index + 1),
                                   torch::nn::Linear(shapes[index].first, shapes[index].second)));
  }
};
